"""Split-KV combine shared by every kernel family: merges the partials a split kernel left in the workspace
(fp32, or the output dtype as cute_sm90 stores them: ``Workspace.partials_as``) into the final output and
natural-log LSE (``kernel.launch_combine``).

Two layouts, one per split plan (ops/plan.py): the uniform plan's ``part = (b * q_len * H + row) *
num_splits + split`` (the combine recomputes each request's split count from seq_lens), and the balanced
plan's ``part = slot * q_len * H + row`` (the combine reads the split list the split kernel wrote to
``workspace.split_index``). Written in Triton, so it runs wherever any family runs; a family that merges its
own partials declares ``combine="own"`` in its manifest (xqa_sm120).

No ``MANIFEST`` here: this is not a decode kernel, and importing this package imports nothing heavy.
"""
