"""A griffe extension for the API pages of the documentation site (``mkdocs.yml``):
it turns the reStructuredText markup of pimm's docstrings into Markdown.

pimm's docstrings use two pieces of reST that Markdown renders as noise:

* cross-reference roles, ``:class:`~pimm.engines.observe.metrics.MetricChannel```,
  ``:meth:`flush```, ``:mod:`pimm.engines.optim.oom_backoff```. Each becomes an
  optional cross-reference (mkdocs-autorefs): a link when the site documents
  that object, plain code otherwise, so a reference to something the API pages
  leave out never breaks the strict build;
* the literal-block marker: a paragraph ending in ``::`` (or a line holding
  only ``::``) before an indented block. The indented block already is a code
  block in Markdown; the marker becomes ``:`` (or disappears).

Writing the docstrings in Markdown instead would make them worse to read in
the source and in ``help()``; no published griffe extension translates
inline Sphinx roles, so this one does, in a few lines. Registered in
``mkdocs.yml`` under the python handler's ``extensions``.
"""

from __future__ import annotations

import re

from griffe import Extension, Object

# :class:`~pimm.a.B`, :meth:`B.flush`, :func:`f` ...; group 1: "~" (show the last part only).
_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([\w.]+)(?:\(\))?`")
_LITERAL_MARKER = re.compile(r"(\S)::[ \t]*$", re.M)  # "text::" at the end of a line
_LONE_MARKER = re.compile(r"^[ \t]*::[ \t]*$\n?", re.M)  # a line holding only "::"


def rest_to_markdown(text: str, module: str = "", owner: str = "") -> str:
    """``text`` with reST roles as optional cross-references and ``::`` markers
    removed. A role without the package name is looked up relative to the
    docstring's place: ``:meth:`flush``` in ``owner`` (the class or module
    whose docstring, or whose method's, this is), ``:meth:`MetricChannel.flush```
    in ``module``."""

    def role(match: re.Match) -> str:
        short, target = match.group(1), match.group(2)
        shown = target.rsplit(".", 1)[-1] if short else target
        if target.startswith("pimm.") or not module:
            identifier = target
        elif "." in target:
            identifier = f"{module}.{target}"
        else:
            identifier = f"{owner or module}.{target}"
        return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'

    text = _ROLE.sub(role, text)
    text = _LONE_MARKER.sub("", text)
    return _LITERAL_MARKER.sub(r"\1:", text)


class RestMarkup(Extension):
    """Rewrite every docstring once its object is loaded."""

    def on_object(self, *, obj: Object, **kwargs) -> None:
        if obj.docstring is not None:
            owner = obj if obj.is_module or obj.is_class else obj.parent
            obj.docstring.value = rest_to_markdown(obj.docstring.value, obj.module.path, owner.path)
