"""python -m shared.patches [--update | --list]: the patch layer's state on this machine.

    python -m shared.patches            # installed against tested versions, and every upstream source that changed
    python -m shared.patches --update   # rewrite shared/patches/fingerprints.json (after reviewing the changes)
    python -m shared.patches --list     # the registry as the Markdown table of docs/patches.md
"""

from __future__ import annotations

import argparse
import sys

from shared.patches import GROUPS, LIBRARIES, PATCHES, TESTED, installed_version


def table() -> str:
    """The registry as a Markdown table, one row per patch (docs/patches.md holds it; a test keeps them equal)."""
    rows = ["| upstream target | replaced by | why | turned on by | measured or found in | tests |",
            "|---|---|---|---|---|---|"]
    for p in PATCHES:
        group = GROUPS[p.group]
        on = f"always: {group.always}" if group.always else group.setting
        tests = ", ".join(f"`{t}`" for t in p.tests)
        rows.append(f"| `{p.target}` | `{p.replacement}` | {p.why} | {on} (group `{p.group}`) | "
                    f"[{p.docs}](../{p.docs}): {p.docs_row} | {tests} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.patches", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--update", action="store_true", help="rewrite shared/patches/fingerprints.json")
    mode.add_argument("--list", action="store_true", help="print the registry as docs/patches.md's table")
    ns = parser.parse_args(argv)
    if ns.list:
        print(table())
        return 0
    from shared.patches import fingerprints

    if ns.update:
        try:
            record = fingerprints.update()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {fingerprints.RECORD}: {len(record['sources'])} sources of {record['versions']}")
        return 0
    for library, (_, label) in LIBRARIES.items():
        have = installed_version(library)
        print(f"{label}: installed {have}, tested {TESTED[library]}" + ("" if have == TESTED[library] else
                                                                           "  <- the version gate refuses its patches"))
    lines = fingerprints.changed()
    print("\n".join(lines) if lines else f"all {len(fingerprints.names())} upstream sources as recorded")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
