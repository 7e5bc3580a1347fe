"""The drafters: one contract (base.py: what a drafter proposes, and what it needs of the target, declared as class
attributes the loop reads), a file per method's drafter, factories.py (the drafter each method builds from its
options) and the job memory (job_memory.py: a decode actor's outputs so far, over suffix_tree.py) that `suffix`
and `auto` draft from."""
