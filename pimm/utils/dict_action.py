"""Upstream pimm's ``--options`` parsing (mmcv's ``DictAction``), for scripts
written against it: ``parser.add_argument("--options", nargs="+",
action=DictAction)`` turns ``KEY=VALUE`` tokens into a dict.

Its rules are upstream's, not those of pimm's own ``--options``
(:mod:`pimm.utils.config_options`, Python literals): a value is an int, a
float, ``true``/``false`` (any case) or else a string; ``V1,V2`` and
``[V1,V2]`` are lists, ``(V1,V2)`` a tuple, nested as written
(``[(1,2),(3,4)]``); quotes around the whole value and every space are dropped.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["DictAction"]


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


def _value(text: str, token: str) -> Any:
    if text.count("(") != text.count(")") or text.count("[") != text.count("]"):
        raise argparse.ArgumentError(None, f"--options {token!r}: its brackets do not balance")
    if text.startswith("(") and text.endswith(")"):
        inner, kind = text[1:-1], tuple
    elif text.startswith("[") and text.endswith("]"):
        inner, kind = text[1:-1], list
    elif "," in text:
        inner, kind = text, list
    else:
        return _scalar(text)
    items = [_value(part, token) for part in _split_top_level(inner)] if inner else []
    return kind(items)


class DictAction(argparse.Action):
    """``KEY=VALUE`` tokens into ``{KEY: value}`` on the namespace (later tokens
    and later uses of the option add to the same dict; see the module docstring)."""

    @staticmethod
    def parse_value(text: str) -> Any:
        """One ``VALUE`` by upstream's rules."""
        return _value(text.strip("'\"").replace(" ", ""), text)

    def __call__(self, parser, namespace, values, option_string=None):
        options = getattr(namespace, self.dest, None)
        options = dict(options) if isinstance(options, dict) else {}
        for token in values if isinstance(values, (list, tuple)) else [values]:
            key, sep, text = token.partition("=")
            if not sep or not key:
                parser.error(f"{option_string or '--options'} {token!r}: give KEY=VALUE")
            try:
                options[key] = self.parse_value(text)
            except argparse.ArgumentError as err:
                parser.error(str(err))
        setattr(namespace, self.dest, options)
