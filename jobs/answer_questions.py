"""Answer questions from passages (RAG): `python jobs/answer_questions.py --input questions.jsonl`.

Rows need `question` and `context` (the retrieved passages; the first --max-context-chars characters go into the
prompt, compressed R times with --compress-context R, and drafters that copy from the context see all of it), or a ready `prompt` / `messages`. With a `reference`
answer the row is scored by token F1. Without --input it answers the bundled samples/questions.jsonl; the shipped
workload `workload:rag` asks questions over ACLSum papers. Also runs under `ray job submit --working-dir .`.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobs.common import main_for  # noqa: E402


def add_options(parser):
    parser.add_argument("--max-context-chars", type=int, default=None,
                        help="context characters placed in each prompt (default 6000)")
    parser.add_argument("--compress-context", type=float, default=None, metavar="R",
                        help="put those characters into the prompt compressed R times (in tokens): the words a "
                             "model finds least surprising are dropped (a self-information compressor standing in "
                             "for LLMLingua-2); the question stays whole and copy drafters still see the full "
                             "context. Raise --max-context-chars with R to cover more of the context per prompt")
    parser.add_argument("--compression-model", default=None,
                        help="registry model that scores the compression (default: --model)")


def main(argv: list[str] | None = None) -> int:
    return main_for("answer_questions", __doc__, default_input=str(ROOT / "samples" / "questions.jsonl"),
                   default_methods=["ar", "copyspec"], default_task="qa", default_max_new_tokens=128,
                   add_options=add_options, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
