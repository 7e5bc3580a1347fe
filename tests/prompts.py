"""Varied real prompts for the lossless tests: code edits, summaries, a two-turn revise chat, no repetition."""

CODE_RENAME = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result
'''

CODE_HINTS = '''import re
from collections import Counter


def top_words(text, limit=10, stop_words=None):
    if limit <= 0:
        raise ValueError("limit must be positive")
    stop_words = set(stop_words or ())
    counts = Counter()
    for line in text.splitlines():
        line = line.strip().lower()
        if not line or line.startswith("#"):
            continue
        for word in re.findall(r"[a-z']+", line):
            if word in stop_words or len(word) < 2:
                continue
            counts[word] += 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:limit]


def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''

ARTICLE = (
    "The city council met on Tuesday to discuss the new public library, which has been under construction for "
    "two years. The library will have three floors, a children's reading room, a makerspace with 3D printers, and "
    "a cafe run by local volunteers. Construction costs rose from 12 million to 15 million dollars because of "
    "higher steel prices, and the council voted 7 to 2 to cover the difference from the city's reserve fund. "
    "The head librarian said the building will open in March and that the old library on Main Street will be "
    "turned into a community center. Residents at the meeting asked for longer opening hours on weekends, and "
    "the council promised to review the budget for staff in the autumn."
)

PAPER = (
    "We study speculative decoding, a technique that speeds up inference of large language models by drafting "
    "several tokens with a cheap method and verifying them with the target model in a single forward pass. "
    "Verification keeps the output distribution of the target model unchanged. Our method copies spans from the "
    "context: when the last few generated tokens already appeared in the prompt, the tokens that followed them "
    "are proposed as the draft. On summarization and code editing, where outputs repeat much of the input, the "
    "method accepts long drafts and reaches speed-ups of two to three times without any training."
)

POEM = (
    "The sea is wide and the sea is deep,\n"
    "It sings the sailors off to sleep.\n"
    "The waves are grey, the foam is white,\n"
    "The lighthouse burns through every night.\n\n"
    "The gulls cry out above the bay,\n"
    "The fishing boats set out by day.\n"
    "The harbour bells ring soft and slow,\n"
    "As tides roll in and tides let go.\n\n"
    "The sea is old and the sea is wise,\n"
    "It holds the moon inside its eyes.\n"
    "And when the storm has said its piece,\n"
    "The sea lies down and finds its peace."
)

LOSSLESS_CASES = {
    "code_rename": [{"role": "user", "content": "Rename the variable `total` to `running_sum` in this function "
                     "and return the full updated code.\n\n```python\n" + CODE_RENAME + "```"}],
    "code_hints": [{"role": "user", "content": "Add type hints to this function and return the full code.\n\n"
                    "```python\n" + CODE_HINTS + "```"}],
    "summary_news": [{"role": "user", "content": "Summarize this article in one paragraph, then list every decision the council took "
                     "and every request the residents made.\n\n" + ARTICLE}],
    "summary_paper": [{"role": "user", "content": "Summarize the following abstract section by section: problem, method, "
                      "results, conclusion.\n\n" + PAPER}],
    "chat_revise_poem": [
        {"role": "user", "content": "Write a short poem about the sea."},
        {"role": "assistant", "content": POEM},
        {"role": "user", "content": "Revise your previous answer: keep the poem but make it about a lake, "
         "changing as few words as possible, and add a fourth stanza about the lake at night."},
    ],
    "chat_revise_code": [
        {"role": "user", "content": "Write Python functions that count the top words of a text and merge "
         "overlapping intervals."},
        {"role": "assistant", "content": "```python\n" + CODE_HINTS + "```"},
        {"role": "user", "content": "Rewrite your previous answer with a docstring and comments, "
         "keeping the same code."},
    ],
    "no_repetition_story": [{"role": "user", "content": "Tell me an original story about a robot who learns to "
                             "paint."}],
    "no_repetition_facts": [{"role": "user", "content": "Give me five facts about volcanoes."}],
}

# New tokens per lossless case: long enough for many draft/verify steps per row (a real-model step costs ~80 ms on 2
# cores); two rows finish while the others still run.
LOSSLESS_MAX_NEW = {name: {"summary_paper": 24, "no_repetition_facts": 12}.get(name, 32) for name in LOSSLESS_CASES}


def lossless_items(engine):
    """The lossless cases as batch items, each with its LOSSLESS_MAX_NEW."""
    from specdec_core.engine import BatchItem
    from specdec_core.loop.requests import DecodeParams

    return [BatchItem(name, engine.prompt_ids(messages=messages), DecodeParams(max_new_tokens=LOSSLESS_MAX_NEW[name]))
            for name, messages in LOSSLESS_CASES.items()]
