"""The status page at `/`: each batch's progress, counts, ETA and links to its files and gallery."""

from __future__ import annotations

import time

from jinja2 import Environment

from .objects import BatchRecord, FileRecord
from .store import ACTIVE

__all__ = ["status_page"]

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchgen serve</title>
{% if active %}<meta http-equiv="refresh" content="5">{% endif %}
<style>
body{font:14px system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;width:100%}td,th{padding:.4em .6em;border-bottom:1px solid #ddd;text-align:left}
.bar{width:12em;height:.8em;background:#eee;border-radius:.4em;overflow:hidden;display:inline-block}
.bar span{display:block;height:100%;background:#3a7}.failed{color:#b33}
</style></head>
<body data-batches="{{ batches|length }}" data-active="{{ active }}">
<h1>batchgen serve</h1>
<p>Model: <code>{{ model or "from the preset" }}</code>. Batches run one after another, oldest first.</p>
{% if not batches %}<p>No batches yet.</p>{% else %}
<table><thead><tr><th>Batch</th><th>Status</th><th>Progress</th><th>Requests</th><th>ETA</th>
<th>Created</th><th>Metadata</th><th>Results</th></tr></thead><tbody>
{% for b in batches %}
<tr class="batch" data-id="{{ b.id }}" data-status="{{ b.status }}" data-completed="{{ b.request_counts.completed }}" data-failed="{{ b.request_counts.failed }}" data-total="{{ b.request_counts.total }}" data-share="{{ share(b) }}">
<td><code>{{ b.id }}</code><br><small>{{ files.get(b.input_file_id).filename if files.get(b.input_file_id) else b.input_file_id }}</small></td>
<td class="{{ 'failed' if b.status == 'failed' else '' }}">{{ b.status }}</td>
<td><span class="bar" title="{{ share(b) }}%"><span style="width:{{ share(b) }}%"></span></span> {{ share(b) }}%</td>
<td>{{ b.request_counts.completed }} done, <span class="failed">{{ b.request_counts.failed }} failed</span> of {{ b.request_counts.total }}</td>
<td>{{ eta(b) }}</td>
<td>{{ when(b.created_at) }}</td>
<td>{% for k, v in (b.metadata or {}).items() %}<code>{{ k }}</code>: {{ v }}<br>{% endfor %}</td>
<td>{% if b.output_file_id %}<a class="output" href="v1/files/{{ b.output_file_id }}/content">output</a> {% endif %}
{% if b.error_file_id %}<a class="errors" href="v1/files/{{ b.error_file_id }}/content">errors</a> {% endif %}
{% if b.output_file_id or b.error_file_id %}<a class="gallery" href="batches/{{ b.id }}/gallery">gallery</a>{% endif %}
{% for e in (b.errors or {}).get("data", [])[:5] %}<div class="failed">{% if e.line %}line {{ e.line }}: {% endif %}{{ e.message }}</div>{% endfor %}
</td></tr>
{% endfor %}</tbody></table>{% endif %}
</body></html>
"""

_TEMPLATE = Environment(autoescape=True).from_string(_PAGE)


def _share(b: BatchRecord) -> int:
    counts = b.request_counts
    total = counts.get("total") or 0
    if b.status == "completed":
        return 100
    return int(100 * (counts.get("completed", 0) + counts.get("failed", 0)) / total) if total else 0


def _eta(b: BatchRecord) -> str:
    if b.status not in ACTIVE or b.eta_s is None:
        return ""
    minutes, seconds = divmod(int(b.eta_s), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _when(t: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else ""


def status_page(batches: list[BatchRecord], files: dict[str, FileRecord], model: str | None) -> str:
    active = sum(b.status in ACTIVE for b in batches)
    return _TEMPLATE.render(
        batches=batches, files=files, model=model, active=active, share=_share, eta=_eta, when=_when
    )
