"""The methods catalogue (``docs/methods_catalogue.md``), generated from the policy registry so
that it lists exactly what ``kvjax.policies.names()`` registers (``tests/test_docs.py`` checks).

``python docs/catalogue.py`` prints it; the docs build writes it (``docs/conf.py``).
"""

from __future__ import annotations

import pathlib
import re

from kvjax import policies

ARXIV = re.compile(r"arXiv (\d{4}\.\d{4,5})")
# owner/repository at the start of a reference, or after "; " (never a path inside backticks)
GITHUB = re.compile(r"(^|; )([A-Za-z0-9][\w-]*/[\w.-]*[\w-])(?=[ ,;)]|$)")
KVPRESS = re.compile(r"\bkvpress 0\.5\.5\b")


def _kind(policy: policies.Policy) -> str:
  return "decode-time" if policy.acts_at_decode else "prefill-time"


def _code(text: str) -> str:
  return f"`{text}`" if text else "—"


def _defaults(policy: policies.Policy) -> str:
  shared = {"num_kv_heads": None, "gqa": "mean", "channel_ratio": None, "decode_every": None}
  own = {k: v for k, v in policy.options.items() if shared.get(k, object()) != v}
  return ", ".join(f"`{k}={v!r}`" for k, v in own.items()) or "—"


def linked(text: str) -> str:
  """``text`` (a paper or reference-code line) with its arXiv ids and repositories as links;
  code spans are left as they are."""
  parts = text.split("`")
  for i in range(0, len(parts), 2):  # outside backticks
    part = ARXIV.sub(r"[arXiv \1](https://arxiv.org/abs/\1)", parts[i])
    part = GITHUB.sub(r"\1[\2](https://github.com/\2)", part)
    parts[i] = KVPRESS.sub("[kvpress 0.5.5](https://github.com/NVIDIA/kvpress)", part)
  return "`".join(parts)


def entry(name: str) -> dict[str, str]:
  """One policy's catalogue entry: its class, kind, evidence, defaults and provenance."""
  policy = policies.make(name)
  source = policies.provenance(name)
  return {
    "name": name,
    "class": type(policy).__name__,
    "summary": policies.doc(name),
    "kind": _kind(policy),
    "allocator": type(policy.allocator).__name__,
    "evidence": ", ".join(f"`{f}`" for f in sorted(policy.evidence_fields)) or "none",
    "defaults": _defaults(policy),
    "paper": source["paper"] or "—",
    "code": source["code"] or "—",
    "differs": source["differs"] or "none known",
  }


def markdown() -> str:
  """The catalogue: a summary table, then one section per registered policy."""
  entries = [entry(name) for name in policies.names()]
  lines = [
    "| name | class | allocator | kind | evidence |",
    "|---|---|---|---|---|",
  ]
  lines += [
    f"| [`{e['name']}`](#policy-{e['name'].replace('_', '-')}) | `{e['class']}` | "
    f"`{e['allocator']}` | {e['kind']} | {e['evidence']} |"
    for e in entries
  ]
  for e in entries:
    lines += [
      "",
      f"({'policy-' + e['name'].replace('_', '-')})=",
      f"## `{e['name']}`",
      "",
      e["summary"],
      "",
      f"- **Paper:** {linked(e['paper'])}",
      f"- **Reference code followed:** {linked(e['code'])}",
      f"- **Class:** `kvjax.policies.{e['class']}`, allocator `{e['allocator']}`; {e['kind']}",
      f"- **Evidence:** {e['evidence']}",
      f"- **Defaults:** {e['defaults']}",
      f"- **Differences from the reference:** {e['differs']}",
    ]
  return "\n".join(lines) + "\n"


def write(path: str | pathlib.Path) -> None:
  """Writes the catalogue to ``path`` when its text changed (Sphinx then rebuilds the page)."""
  path = pathlib.Path(path)
  text = markdown()
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


if __name__ == "__main__":
  print(markdown())
