"""Turn a request (plain prompt or chat messages) into prompt token ids; read prompt files with strict UTF-8; a
tokenizer's fingerprint, which says when two tokenizers give the same ids."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import BadRequestError


def read_text_file(path: str | Path) -> str:
    try:
        return Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise BadRequestError(f"file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"{path} is not valid UTF-8 (byte {exc.start}): re-encode it as UTF-8") from None


def validate_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequestError(f"message {i} needs a string 'role'")
        if not isinstance(message.get("content"), str):
            raise BadRequestError(f"message {i} needs a string 'content'")
    if not any(m["content"].strip() for m in messages):
        raise BadRequestError("empty prompt: every message is empty")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_messages_file(path: str | Path) -> list[dict]:
    text = read_text_file(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequestError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    return validate_messages(data)


def check_prompt_text(prompt: str | None) -> None:
    """A plain prompt with nothing to decode is refused (before any model is loaded, where a caller can)."""
    if not prompt or not prompt.strip():
        raise BadRequestError("empty prompt: nothing to decode")


def build_prompt_ids(tokenizer, prompt: str | None = None, messages: list[dict] | None = None, raw: bool = False) -> list[int]:
    """A plain prompt goes in as one user message through the chat template, unless raw or there is no template."""
    if (prompt is None) == (messages is None):
        raise BadRequestError("give exactly one of prompt or messages")
    if messages is None:
        check_prompt_text(prompt)
        if raw or not getattr(tokenizer, "chat_template", None):
            return list(tokenizer(prompt)["input_ids"])
        messages = [{"role": "user", "content": prompt}]
    messages = validate_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequestError("this model has no chat template: send a plain prompt instead of messages")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary (token -> id): equal fingerprints mean equal token ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]
