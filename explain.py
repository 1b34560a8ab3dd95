"""Recompute and print the cost table of a `compare.py --explain` report (the logic: harness/explain.py).

    python explain.py REPORT/explain.json    # REPORT: the --out folder of a `compare.py --explain` run
"""

from harness.explain import main

if __name__ == "__main__":
    main()
