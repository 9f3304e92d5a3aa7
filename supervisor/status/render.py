"""HTML for the status page: templates filled with escaped values.

Every value is escaped on its way into a template unless it is :class:`Html`, which only
:func:`esc` and :func:`fill` make (from escaped parts). A recipient ID, an operation's
reason or a flash message is data from outside: it is never markup.
"""

from __future__ import annotations

import html
from functools import cache
from importlib import resources
from string import Template
from typing import Any
from urllib.parse import quote

from supervisor.model import Operation
from supervisor.reconcile import RESOLUTIONS
from supervisor.status.auth import Session
from supervisor.status.views import DASH, clock_text, date_text, duration_text


class Html(str):
    """Text that is markup already: inserted as it is."""

    __slots__ = ()


def esc(value: object) -> Html:
    return Html(html.escape(str(value), quote=True))


@cache
def _template(name: str) -> Template:
    return Template(resources.files("supervisor.status").joinpath("templates", name)
                    .read_text(encoding="utf-8"))


def fill(name: str, **values: object) -> Html:
    """The template ``name`` with every value escaped (:class:`Html` ones as they are)."""
    return Html(_template(name).substitute(
        {k: v if isinstance(v, Html) else esc(v) for k, v in values.items()}))


def join(parts: list[Html]) -> Html:
    return Html("".join(parts))


def layout(title: str, body: Html, session: Session | None) -> Html:
    nav = Html("")
    script = Html("")
    if session is not None:
        nav = Html(
            f'<span class="who" id="role">{esc(session.role)}</span>'
            '<form method="post" action="/logout" class="inline">'
            f'{csrf_field(session)}<button type="submit" id="logout">Log out</button></form>')
        script = Html('<script src="/static/status.js" defer></script>')
    return fill("layout.html", title=title, nav=nav, body=body, script=script)


def csrf_field(session: Session) -> Html:
    return Html(f'<input type="hidden" name="csrf" value="{esc(session.csrf)}">')


def login_page(message: str | None = None) -> Html:
    text = Html("") if message is None else \
        Html(f'<p class="flash error" role="alert">{esc(message)}</p>')
    return layout("Log in · cleanup-supervisor", fill("login.html", message=text), None)


def message_page(title: str, text: str, session: Session | None) -> Html:
    body = Html(f'<section class="card"><h1>{esc(title)}</h1><p>{esc(text)}</p>'
                '<p><a href="/">Back to the status page</a></p></section>')
    return layout(f"{title} · cleanup-supervisor", body, session)


def _resolve_form(op: Operation, session: Session, by: str) -> Html:
    options = join([Html(f'<option value="{esc(o)}">{esc(o)}</option>') for o in RESOLUTIONS])
    return Html(
        f'<form method="post" action="/status/operations/{esc(quote(op.id, safe=""))}/resolve" '
        f'class="resolve" data-operation="{esc(op.id)}">{csrf_field(session)}'
        '<select name="outcome" required aria-label="outcome">'
        f'<option value="" selected disabled>outcome</option>{options}</select>'
        f'<input name="by" required maxlength="500" placeholder="your name" value="{esc(by)}" '
        'aria-label="who decides" autocomplete="name">'
        '<input name="reason" required maxlength="500" placeholder="why (recorded)" '
        'aria-label="why">'
        '<button type="submit">Resolve</button></form>')


def ambiguous_table(ops: list[Operation], session: Session, more: bool, by: str) -> Html:
    if not ops:
        return Html('<p class="muted" id="no-ambiguous">None: every operation has an outcome '
                    'or is still being worked.</p>')
    head = ("<th>operation and run</th><th>recipient</th><th>attempts</th>"
            "<th>since</th><th>evidence so far</th>")
    if session.can_resolve:
        head += "<th>decision (recorded with who and why)</th>"
    rows = []
    for op in ops:
        cells = [Html(f'<code>{esc(op.id)}</code><br><code class="muted">{esc(op.run_id)}</code>'),
                 Html(f"<code>{esc(op.recipient_id)}</code>"), esc(op.attempts),
                 Html(f'<span class="nowrap">{esc(date_text(op.updated_at))}</span>'),
                 esc(op.reason or DASH)]
        if session.can_resolve:
            cells.append(_resolve_form(op, session, by))
        rows.append(Html(f'<tr data-operation="{esc(op.id)}">'
                         + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"))
    note = Html("")
    if more:
        note = Html('<p class="muted">More are waiting: list them all with '
                    '<code>cleanup-supervisor ambiguous</code>.</p>')
    if not session.can_resolve:
        note = Html(note + '<p class="muted">You are logged in read-only: an operator '
                    '(the operator token) resolves these.</p>')
    return Html(f'<div class="scroll"><table class="ops"><thead><tr>{head}</tr></thead>'
                f'<tbody>{join(rows)}</tbody></table></div>{note}')


# A flash message of the budget card's form: shown there, not beside the resolve forms.
BUDGET_FLASH = "budget"
MAX_ACTIONS_SHOWN = 5


def _limit(value: float | None) -> str:
    return DASH if value is None else f"{value:g}/s"


def budget_card(view: dict[str, Any] | None, session: Session, by: str) -> Html:
    """What holds the workers (a pause, a spent quota), the limits learnt, the latest
    resumes, and for an operator the form that lifts the pause (POST-redirect-GET)."""
    if view is None:
        return Html("")
    if view["paused"]:
        pause = Html(f'until {esc(date_text(view["paused_until"]))} '
                     f'({esc(view["pause_reason"] or DASH)})')
    else:
        pause = esc("none")
    held = view["held_for_seconds"]
    facts = [("rate now", esc(_limit(view["rate_per_second"]))),
             ("ceiling", esc(_limit(view["ceiling_per_second"]))),
             ("learnt limit", esc(_limit(view["learnt_limit_per_second"]))),
             ("announced limit", esc(_limit(view["announced_limit_per_second"]))),
             ("pause", pause),
             ("held for", esc(duration_text(held) if held > 0 else "nothing holds"))]
    dl = join([Html(f"<dt>{esc(k)}</dt><dd>{v}</dd>") for k, v in facts])
    rows = join([Html(f'<tr><td class="nowrap">{esc(date_text(a["at"]))}</td>'
                      f'<td>{esc(a["by"])}</td><td>{esc(a["reason"])}</td>'
                      f'<td>{esc("yes" if a["detail"].get("forget_limit") else "no")}</td></tr>')
                 for a in view.get("operator_actions", [])[:MAX_ACTIONS_SHOWN]])
    actions = Html('<p class="muted small">No resume recorded.</p>') if not rows else Html(
        '<table class="ops"><thead><tr><th>when</th><th>by</th><th>why</th>'
        f'<th>limit forgotten</th></tr></thead><tbody>{rows}</tbody></table>')
    if session.can_resolve:
        form = Html(
            f'<form method="post" action="/status/budget/resume" id="budget-resume">'
            f'{csrf_field(session)}'
            f'<input name="by" required maxlength="500" placeholder="your name" '
            f'value="{esc(by)}" aria-label="who decides" autocomplete="name">'
            '<input name="reason" required maxlength="500" placeholder="why (recorded)" '
            'aria-label="why">'
            '<label><input type="checkbox" name="forget_limit" value="1"> also forget the '
            'learnt limit</label>'
            '<button type="submit">Resume</button></form>')
    else:
        form = Html('<p class="muted">You are logged in read-only: an operator lifts a '
                    'pause.</p>')
    flash = join([Html(f'<p class="flash {esc(kind)}" role="status">{esc(text)}</p>')
                  for kind, text in session.flash if BUDGET_FLASH in kind.split()])
    return Html(f'<section class="card" id="budget"><h2>Rate budget</h2>{flash}'
                f'<dl class="eta">{dl}</dl>{form}<h3>Resumes</h3>{actions}</section>')


def status_page(data: dict[str, Any], ops: list[Operation], more: bool,
                session: Session, by: str, budget: Html | None = None) -> Html:
    current = data["current"]
    fields: dict[str, Any] = dict.fromkeys(
        ("run_id", "state", "schedule", "created", "discovered", "deleted", "already_absent",
         "failed", "ambiguous", "unfinished", "rate", "finish", "cutoff", "verdict"), DASH)
    if current is not None:
        fields.update(current["fields"])
    rows = join([Html('<tr>' + "".join(f"<td>{esc(c)}</td>" for c in r["cells"]) + "</tr>")
                 for r in data["runs"]])
    # The page's only messages are the resolve form's: shown beside it, where the
    # redirect after the POST lands (/#ambiguous).
    flash = join([Html(f'<p class="flash {esc(kind)}" role="status">{esc(text)}</p>')
                  for kind, text in session.flash if BUDGET_FLASH not in kind.split()])
    body = fill(
        "status.html", **fields, flash=flash,
        verdict_kind=current["verdict"] if current else "none",
        no_run_hidden=Html("hidden" if current is not None else ""),
        progress_max=max(1, current["discovered"]) if current else 1,
        progress_value=current["settled"] if current else 0,
        updated=clock_text(data["now"]), ambiguous_total=data["ambiguous"],
        ambiguous_table=ambiguous_table(ops, session, more, by), runs_rows=rows,
        budget_card=budget or Html(""))
    return layout("Status · cleanup-supervisor", body, session)
