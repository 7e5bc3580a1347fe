"""Edit documents in bulk: `python jobs/edit_documents.py --input docs.jsonl --instruction "Fix the typos."`.

Rows need `document` (the text to edit) and an `instruction` column unless --instruction gives one for the whole
run (a row's own instruction wins); rows with a ready `prompt` or `messages` work too. Besides the output text each
row stores `diff`, a unified diff of the edited document (the first code block of the output, when the model fenced
it) against the input. With a `reference` (the expected document) the row is scored by exact match. Without --input
it edits the bundled samples/edit_documents.jsonl. Also runs under `ray job submit --working-dir .`.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobs.common import main_for  # noqa: E402


def add_options(parser):
    parser.add_argument("--instruction", default=None,
                        help="edit instruction for every row without its own 'instruction' column")


def main(argv: list[str] | None = None) -> int:
    return main_for("edit_documents", __doc__, default_input=str(ROOT / "samples" / "edit_documents.jsonl"),
                   default_methods=["ar", "copyspec"], default_task="edit", default_max_new_tokens=512,
                   add_options=add_options, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
