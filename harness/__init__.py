"""The harness: runs the two training paths as processes and reports on them.

  launch.py    start a run (torchrun of a path's script) and stop it; run a group of runs side by side
  order.py     the one order policy for interleaved runs (which path goes first in each round)
  report.py    per-path summaries, parity of the two paths, the table, markdown and the plot
  explain.py   compare.py --explain: what each Lightning overhead costs
  autotune.py  compare.py --autotune: search micro-batch, checkpointing and ZeRO knobs
  reference.py the reference rows (compare.py --reference): unsharded, the PyTorch baseline and FSDP2, run by launch.py

compare.py is the command line over this library; benchmarks/ import it too, and it neither imports nor runs them.
"""
