"""Recompute and print the cost table of a `compare.py --explain` report (the logic: harness/explain.py).

    python explain.py benchmarks/results/explain_1xh200/explain.json
"""

from harness.explain import main

if __name__ == "__main__":
    main()
