"""Command-line flags from the config dataclasses: flag names are field names (`--micro_batch`, `--micro-batch`).

Both paths build their parser here, so a flag means the same thing everywhere. The original study's flag names
keep working as aliases (`--batch_size_per_gpu`), and so does DeepSpeed's `--deepspeed_config`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import typing

from shared.train.config import LEVERS, MORE_OPTIONS, TrainConfig

# --help's group of the fields in LEVERS, listed after the common flags
LEVERS_TITLE = ("expert levers: speed only (compare.py's GPU default sets those measured faster; their "
                "measurements: docs/ledger.md)")
# The original min-LLM scripts' flags, mapped to our field names.
ALIASES = {"micro_batch": ["--batch_size_per_gpu", "--batch-size-per-gpu"],
           # DeepSpeed's own name for it; its autotuner passes each experiment's config as --deepspeed_config.
           "ds_config": ["--deepspeed_config", "--deepspeed-config"]}


def check_out_flag(parser: argparse.ArgumentParser, path, example: str = "result.json") -> None:
    """parser.error (exit 2, the problem named) when the file --out `path` (if any) cannot be written: a folder in its
    place or no writable folder to create it in (shared/train/distributed.check_output). A benchmark calls it while it
    parses its arguments, so that it refuses the path before it measures instead of failing when it writes."""
    from shared.train.distributed import check_output

    if not path:  # "": the benchmark writes no file
        return
    try:
        check_output("--out", path, example)
    except ValueError as e:
        parser.error(str(e))


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def field_docs(cls) -> dict[str, str]:
    """The docstring under each dataclass field (the config files document fields that way), the base classes'
    fields included (TrainConfig inherits the fused switches from shared/model/config.py FusedSwitches)."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = nxt.value.value.strip()
    return docs


def _named_values(doc: str) -> str:
    """A field doc with the config constants it names (`one of PRESETS`) spelled out for --help."""
    from shared.train import config

    def spell(m: re.Match) -> str:
        value = getattr(config, m.group(0), None)
        return " | ".join(value) if isinstance(value, tuple | dict) else m.group(0)

    return re.sub(r"\b[A-Z][A-Z_]{3,}\b", spell, doc)


def add_config_args(parser: argparse.ArgumentParser, cls=TrainConfig) -> None:
    """One flag per dataclass field, typed from the annotation, defaulting to None (= the field's default); the
    fields in LEVERS go to a group of their own (LEVERS_TITLE), which --help lists after the common flags."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        group = (option_group(parser, LEVERS_TITLE) if f.name in LEVERS
                 else option_group(parser, MORE_TITLE) if f.name in MORE_OPTIONS else parser)
        tp = hints[f.name]
        args = typing.get_args(tp)
        if args and type(None) in args:  # X | None
            tp = next(a for a in args if a is not type(None))
        names = [f"--{f.name}"]
        if "_" in f.name:
            names.append(f"--{f.name.replace('_', '-')}")
        names += ALIASES.get(f.name, [])
        doc = f"{_named_values(docs.get(f.name, ''))} (default: {f.default})".replace("%", "%%")
        if tp is bool:
            group.add_argument(*names, dest=f.name, type=_parse_bool, nargs="?", const=True, default=None, help=doc)
        else:
            group.add_argument(*names, dest=f.name, type=tp, default=None, help=doc)


def config_from_args(ns: argparse.Namespace, cls=TrainConfig, **fixed):
    """Build `cls` from parsed flags; flags left unset keep the dataclass default."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    kwargs.update(fixed)
    return cls(**kwargs)


# A number with a leading minus, as float() reads it: argparse (3.11, 3.12) takes only "-1" and "-.5" for one, so
# `--lr -1e-3` read "-1e-3" as an unknown option and failed with "expected one argument" instead of reaching the
# value's own check (TrainConfig: "lr must be positive").
NEGATIVE_NUMBER = re.compile(r"^-(\d[\d_]*\.?\d*|\.\d+)([eE][+-]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


MORE_TITLE = "more options (shape overrides, optimizer details, diagnostics, logging)"


def option_group(parser: argparse.ArgumentParser, title: str):
    """The parser's group of options titled `title` (LEVERS_TITLE, MORE_TITLE: --help leaves them out, --help-all
    lists them), made on first use."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser for commands with many flags: the description's examples keep their lines in --help, a
    bad value exits 2 with its one-line message and a pointer to --help, not the whole usage block before it, and
    a negative number in any notation float() reads (-1e-3, -2.) is a flag's value, not an option."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, usage="%(prog)s [options]", **kwargs)
        # argparse's own pattern, consulted wherever it decides whether an argument is an option (no flag here
        # looks like a negative number, so such an argument is then always a value)
        self._negative_number_matcher = NEGATIVE_NUMBER
        self.add_argument("--help-all", "--help_all", action=_HelpAll, nargs=0,
                          help="show every option: the common ones, the expert levers and the rest")

    HIDDEN = (LEVERS_TITLE, MORE_TITLE)  # the groups --help leaves out

    def format_help(self, everything: bool = False) -> str:
        """--help: the common options, and how many more --help-all shows; everything: all of them."""
        if everything:
            return super().format_help()
        hidden = [g for g in self._action_groups if g.title in self.HIDDEN]
        kept = self._action_groups
        self._action_groups = [g for g in kept if g not in hidden]
        try:
            text = super().format_help()
        finally:
            self._action_groups = kept
        n = sum(1 for g in hidden for a in g._group_actions)
        return text + (f"\n{n} more options (expert levers, shape overrides, diagnostics): {self.prog} --help-all\n"
                       if n else "")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(all flags: {self.prog} --help-all)\n")


class _HelpAll(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(parser.format_help(everything=True), end="")
        parser.exit()


def apply_profile(ns: argparse.Namespace, gpus: int, **facts):
    """Fill the speed flags `ns` leaves unset from its --profile (default: the machine's; shared/train/profiles.py)
    and record the profile's name in ns.profile; returns the profiles.Resolved. `--profile list` prints the table
    and exits 0. ValueError for a profile this machine cannot run."""
    import torch

    from shared.train import profiles

    if ns.profile == "list":
        print(profiles.table())
        raise SystemExit(0)
    cuda = torch.cuda.is_available()
    if cuda and "gpu_memory_gib" not in facts:
        from shared.train.distributed import gpu_memory_gib

        facts["gpu_memory_gib"] = gpu_memory_gib()
    given = {f.name: getattr(ns, f.name, None) for f in dataclasses.fields(TrainConfig)}
    resolved = profiles.resolve(given, ns.profile, cuda=cuda, gpus=gpus, **facts)
    for key, value in resolved.filled.items():
        setattr(ns, key, value)
    ns.profile = resolved.name
    return resolved


def parse_train_config(argv: list[str] | None, description: str, world=None) -> TrainConfig:
    """Parse argv into a TrainConfig, its speed settings filled from --profile for a run of `world(ns)` processes
    (default: the launcher's WORLD_SIZE, else 1); a bad value exits with status 2 and a message naming it."""
    parser = Parser(description=description)
    add_config_args(parser)
    # Launchers pass these; DeepSpeed's launcher adds --local_rank=N.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    from shared.train.distributed import launched_rank, launched_world

    try:
        resolved = apply_profile(ns, world(ns) if world else launched_world())
        if launched_rank() == 0:
            print(resolved.line(), flush=True)
        return config_from_args(ns)
    except ValueError as e:
        parser.error(str(e))


def to_argv(cfg) -> list[str]:
    """The flags that rebuild `cfg` in another process (every field set explicitly; None fields omitted)."""
    argv = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None:
            continue
        argv += [f"--{f.name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv
