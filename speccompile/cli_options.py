"""The request's options on the command line, made from the request spec (core/params.GenerationParams).

Each field that has a flag (`options_with_flags()`) becomes one click option: the flag and help from
its `Option` metadata, the type from its annotation (an enum's values as the choices, a tuple field
repeated, a bool a flag), and no default unless the command gives one, so that `params_from_cli`
leaves a field the command line did not set at the record's default. A new field with a flag is an option of `generate`,
`bench` and `profile` without a line here.
"""

import enum
import functools
import types
import typing

import click

from speccompile.core.params import GenerationParams, options_with_flags

ALIASES = {"gamma": ("--num-speculative-tokens",)}  # vLLM's name for γ, which scripts use
HINTS = typing.get_type_hints(GenerationParams)


class IntOrText(click.ParamType):
    """An `int | str` field (γ: a number or "auto"): an integer where the text is one, else the text
    (the record and the runtime say what they accept)."""

    name = "integer|text"

    def convert(self, value, param, ctx):
        try:
            return int(value)
        except (TypeError, ValueError):
            return value


def generation_options(command=None, *, skip: tuple[str, ...] = (), defaults: dict | None = None):
    """Add an option per GenerationParams field with a flag, but those in `skip` (a command that means
    something else by them declares its own). `defaults`: the command's own defaults for some fields
    (shown in the help, and passed on as if given). Used bare (@generation_options) or called."""
    if command is None:
        return functools.partial(generation_options, skip=skip, defaults=defaults)
    for spec, meta in reversed(options_with_flags()):  # click lists options in decoration order, reversed
        if spec.name not in skip:
            command = _option(spec, meta, (defaults or {}).get(spec.name))(command)
    return command


def params_from_cli(options: dict) -> GenerationParams:
    """The request the parsed options ask for: the fields given (the command line's values), the record's
    defaults for the others. `options` holds generation options only, by field name."""
    return GenerationParams.of(**{name: value for name, value in options.items() if value not in (None, ())})


def _option(spec, meta, default):
    kind, multiple = _click_type(HINTS[spec.name])
    shown = spec.default if default is None else default
    unshown = shown is None or shown is False or shown == ()  # nothing to say: the help says what unset means
    help_ = meta.help if unshown else f"{meta.help}  [default: {_shown(shown)}]"
    names = (meta.flag, *ALIASES.get(spec.name, ()), spec.name)
    if kind is bool:
        return click.option(*names, is_flag=True, default=None, help=help_)
    return click.option(*names, type=kind, multiple=multiple, default=default, help=help_)


def _click_type(hint) -> tuple:
    """(click type, or bool for a flag; whether the option repeats) for a field's annotation."""
    origin, args = typing.get_origin(hint), [a for a in typing.get_args(hint) if a is not type(None)]
    if origin is tuple:  # tuple[str, ...]: repeat the option
        return _click_type(args[0])[0], True
    if origin in (typing.Union, types.UnionType):
        if set(args) == {int, str}:
            return IntOrText(), False
        (hint,) = args  # X | None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return click.Choice([member.value for member in hint]), False
    return hint, False


def _shown(value) -> str:
    return value.value if isinstance(value, enum.Enum) else str(value)
