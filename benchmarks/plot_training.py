"""Loss curves of training runs from their RunResult JSONs: per-step training loss and the validation points.

    python benchmarks/plot_training.py benchmarks/results/kjv350m_1xh200/kjv350m_*.json \
        --out benchmarks/results/kjv350m_1xh200/loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from shared.train.cli import check_out_flag  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="RunResult JSON files (one curve each)")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    ns = p.parse_args(argv)
    check_out_flag(p, ns.out, "loss.png")  # a folder or an unwritable path: refused before it measures
    fig, ax = plt.subplots(figsize=(8, 4.5))
    title = None
    for path in ns.results:
        if not path.is_file():
            p.error(f"{path} does not exist")
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            p.error(f"{path} is not a readable JSON file ({type(e).__name__}: {e})")
        if not isinstance(r, dict) or "losses" not in r or "path" not in r:
            p.error(f"{path} is not a RunResult JSON (no 'losses'/'path')")
        start = r.get("extra", {}).get("start_step", 0)
        steps = range(start + 1, start + len(r["losses"]) + 1)
        line, = ax.plot(steps, r["losses"], lw=0.8, alpha=0.7, label=f"{r['path']}: train")
        val = r.get("extra", {}).get("val", [])
        if val:
            ax.plot([v["step"] for v in val], [v["val_loss"] for v in val], "o-", color=line.get_color(),
                    ms=4, label=f"{r['path']}: validation")
        title = (f"{r['preset']} ({r['n_params'] / 1e6:.0f}M params), {r['world_size']} x {r['device']['name']}, "
                 f"ZeRO-{r['train']['stage']} {r['train']['precision']}, data {Path(r['train']['data']).name}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(ns.out, dpi=110, format=ns.out.suffix[1:] or "png")  # no suffix: a PNG at --out, not --out.png
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
