"""Command-line flags generated from the config dataclasses (`ferrum/config.py`), as vLLM's
EngineArgs does: one flag per option field, named after it (`max_model_len` ->
`--max-model-len`), with its type, default, choices and help from the field. Commands that
build an engine (`run`, `serve`, `bench ...`) share them; `config_from_args` turns the parsed
flags back into an EngineConfig.

Importing this module does not import torch, so a command can print before the engine loads.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing

from ferrum.config import EngineConfig, config_groups, option_default, option_fields


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default: appends "(default: X)" to a help text that does not
    already have a "(default..." part (None-default options say there what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("(default" in text or action.default in (None, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            # `--no-hf` (store_false, default True) means: off unless given
            return text + " (default: not given)"
        return text + " (default: %(default)s)"


def _value_type(annotation) -> type:
    """int / float / str / bool from a field's annotation, `X | None` included."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _as_argparse_type(parse):
    """A parser that raises ValueError -> one argparse accepts with our message."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def _dest(f: dataclasses.Field) -> str:
    """The argparse dest of an option: its flag's name when the field sets one (e.g.
    `seed` -> `--engine-seed` -> engine_seed, so that `run --seed` stays the sampling seed)."""
    flag = f.metadata.get("flag")
    return flag.lstrip("-").replace("-", "_") if flag else f.name


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """Add one flag per engine option field (EngineConfig and its cache, scheduler and
    parallel parts); with model_positional, the model as an optional positional argument."""
    for name, cls in config_groups():
        group = p.add_argument_group(f"engine: {name}" if name else "engine")
        hints = typing.get_type_hints(cls)
        for f in option_fields(cls):
            meta = f.metadata
            if not meta.get("cli", True):
                continue
            default = option_default(f)
            if meta.get("positional"):
                if model_positional:
                    p.add_argument(f.name, nargs="?", default=default,
                                   help=f"{meta['help']} (default: {default})")
                continue
            flags = [meta.get("flag") or "--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
            kind = _value_type(hints[f.name])
            text = meta["help"] + (f" [env {meta['env']}]" if meta["env"] else "")
            kw = {"dest": _dest(f), "default": default, "help": text}
            if kind is bool:
                kw["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
            else:
                parse = meta.get("parse")
                kw["type"] = _as_argparse_type(parse) if parse else kind
                kw["metavar"] = meta.get("metavar") or kind.__name__.upper()
                if "choices" in meta:
                    kw["choices"] = meta["choices"]
                    kw.pop("metavar")
            group.add_argument(*flags, **kw)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from flags added by `add_engine_args`. With `--load-format dummy` an
    existing folder or config.json as the model means `dummy:<it>`."""
    kwargs = {f.name: getattr(args, _dest(f)) for _, cls in config_groups()
              for f in option_fields(cls) if hasattr(args, _dest(f))}
    model = kwargs.get("model")
    if (kwargs.get("load_format") == "dummy" and model and not model.startswith("dummy:")
            and os.path.exists(model)):
        kwargs["model"] = f"dummy:{model}"
    return EngineConfig.from_kwargs(**kwargs)
