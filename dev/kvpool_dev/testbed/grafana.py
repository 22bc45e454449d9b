"""The queries of a Grafana dashboard as Prometheus would run them (pure).

Grafana replaces a dashboard's variables before it sends a panel's query: the data source's
`$__rate_interval` and the template variables (`$pool`, `$k8s_namespace`). These functions
do the same, so a test can send every panel's query to a real Prometheus.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    legend: str
    expr: str


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`$name` and `${name}` replaced by `variables[name]`; an unknown variable is an error
    (Prometheus would reject the query anyway, with a less useful message)."""
    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise KeyError(f"dashboard variable ${name} has no value")
        return variables[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


def panel_queries(dashboard: dict, variables: dict[str, str]) -> list[PanelQuery]:
    """Every target of every panel (rows' nested panels too), variables substituted."""
    out = []
    panels = list(dashboard.get("panels", []))
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append(PanelQuery(panel.get("title", ""), target.get("legendFormat", ""),
                                      substitute(target["expr"], variables)))
    return out


def variable_queries(dashboard: dict, variables: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Template variables of type query that use `label_values(match, label)`:
    name -> (match selector, label), variables substituted."""
    out = {}
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var["query"]["query"] if isinstance(var.get("query"), dict) else var.get("query", "")
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q)
        if m:
            out[var["name"]] = (substitute(m.group(1), variables), m.group(2))
    return out
