"""Summarize documents: `python jobs/summarize.py --input docs.jsonl --method ar --method copyspec`.

Rows need `prompt` (the document, wrapped in a summarization instruction) or `messages`. Without --input it runs the
bundled sample on the embedded local Ray. Also runs as `ray job submit --working-dir . -- python jobs/summarize.py`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs.common import main_for  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return main_for("summarize", __doc__, default_input="workload:sample", default_methods=["ar", "copyspec"],
                   default_task="summarization", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
