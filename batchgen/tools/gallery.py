"""`report`: a results file as one self-contained HTML page, one card per picture."""

from __future__ import annotations

import base64
import hashlib
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2

from ..core.records import ResultRow
from ..input.read import id_key
from ..media.images import IMAGE_FORMATS
from ..output.about import About
from ..output.resume import Replaced
from .results import (
    MediaPolicy,
    Ref,
    asking,
    job_pictures,
    made_by,
    media_columns,
    media_policy,
    read_results,
    results_about,
    staged,
)

__all__ = ["write_gallery"]

_THUMB = 160  # pixels on the long side: enough to recognise, small enough for 10,000 rows
_PAGE_CARDS = 100  # cards per page


def _thumbnail(img) -> str:
    img = img.convert("RGB")
    img.thumbnail((_THUMB, _THUMB))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


_BROWSER_IMAGES = {".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp"}


def _media_thumbs(ref: Ref, kind: str, policy: MediaPolicy, page_dir: Path) -> list[str]:
    """What a card shows: local images the browser can read are linked relative to the page
    (loaded only when their page of cards is shown); data-URL images, images given as bytes
    and a few frames of each video are embedded as small thumbnails; remote URLs are linked
    as they are."""
    from PIL import Image

    if isinstance(ref, bytes):
        if kind != "image":
            return []
        try:
            return [_thumbnail(Image.open(io.BytesIO(ref), formats=IMAGE_FORMATS))]
        except Exception:  # noqa: BLE001 - a broken picture is shown as missing
            return []
    if ref.startswith(("http://", "https://")):
        return [ref] if kind == "image" else []
    try:
        if ref.startswith("data:"):
            data = base64.b64decode(ref.split(",", 1)[1])
            return (
                [_thumbnail(Image.open(io.BytesIO(data), formats=IMAGE_FORMATS))] if kind == "image" else []
            )
        path = policy.path(ref)
        if path is None:
            return []
        if kind == "image":
            with Image.open(path, formats=IMAGE_FORMATS) as img:  # the header only: is it an image?
                if path.suffix.lower() in _BROWSER_IMAGES:
                    return [quote(Path(os.path.relpath(path, page_dir.resolve())).as_posix())]
                return [_thumbnail(img)]
        from ..media.frames import extract_frames

        frames = extract_frames(path, 1.0, 2, 4, max_pixels=160 * 160)
        return [_thumbnail(Image.fromarray(f)) for f in frames[:: max(1, len(frames) // 3)][:3]]
    except Exception:  # a broken file is shown as missing, as its row says
        return []


def _bytes_key(data: bytes) -> str:
    return "image:bytes " + hashlib.sha256(data).hexdigest()[:16]


def _from_job(
    about: About,
    wanted: dict[str, str | None],
    columns: list[tuple[str, str]],
    policy: MediaPolicy,
) -> dict[str, list[tuple[str, list[str]]]]:
    """Thumbnails of the pictures the output does not carry, read again from the job (by id
    key, each picture's key and thumbnail), for the rows that show none."""
    found = job_pictures(about, wanted, columns, policy, _MAX_EMBEDDED)
    return {
        key: [(_bytes_key(p), _media_thumbs(p, "image", policy, Path("."))) for p in pictures]
        for key, pictures in found.items()
    }


_URL_COLUMNS = ("url", "image_url")  # img2dataset's: the picture's source, when nothing else shows it


_MAX_EMBEDDED = 2000  # thumbnails made from bytes (~5 KB each): the page stays ~10 MB at most


def _metrics(r: ResultRow) -> str:
    """Tokens and time for a row that ran; for a failed one, the stages it spent time in."""
    if r["status"] == "ok":
        return (
            f"{r['prompt_tokens']}+{r['completion_tokens']} tokens, {r.get('cached_tokens') or 0} cached, "
            f"{r.get('generate_ms') or 0:.0f} ms"
        )
    stages = [(k[:-3], r.get(k) or 0) for k in ("fetch_ms", "decode_ms", "frames_ms", "generate_ms")]
    return ", ".join(f"{name} {ms:.0f} ms" for name, ms in stages if ms) or ""


def _scores(r: ResultRow) -> str:
    """A row's scores as a line: each choice's probability, the text's logprob per token."""
    parts = [f"{c['choice']} {c['prob']:.2f}" for c in r.get("choice_scores") or []]
    if r.get("score_mean") is not None:
        parts.append(f"text logprob/token {r['score_mean']:.2f}")
    return " · ".join(parts)


def _calls(r: ResultRow) -> str:
    """A row's tool calls as lines: `name(arguments)`."""
    return "\n".join(
        f"→ {c['function']['name']}({c['function']['arguments']})" for c in r.get("tool_calls") or []
    )


def _score(r: ResultRow) -> float | None:
    """What the page sorts a card by: its first choice's probability (VQAScore's yes), else the
    text's logprob per token."""
    scores = r.get("choice_scores") or []
    return scores[0]["prob"] if scores else r.get("score_mean")


class _Thumbs(dict[str, list[str]]):
    """Each picture's thumbnails by key, made once however many rows show it; past
    _MAX_EMBEDDED pictures held as bytes, no more are embedded."""

    def __init__(self, policy: MediaPolicy, folder: Path):
        super().__init__()
        self.policy, self.folder, self.embedded = policy, folder, 0

    def key(self, ref: Ref, kind: str) -> str:
        key = _bytes_key(ref) if isinstance(ref, bytes) else f"{kind}:{ref}"
        if key not in self:
            self.embedded += isinstance(ref, bytes)
            show = not isinstance(ref, bytes) or self.embedded <= _MAX_EMBEDDED
            self[key] = _media_thumbs(ref, kind, self.policy, self.folder) if show else []
        return key


def _entry(r: ResultRow, question: str, made: str, stage: str | None = None) -> dict[str, Any]:
    """A row on its card: its question, its answer (or error), its figures and scores, the
    model and adapter that made it when the run had several, and a staged job's stage."""
    return {
        "id": str(r["id"]),
        "stage": stage or "",
        "stopped": False,  # the row stopped at this stage: its keep_if did not keep it
        "status": r["status"],
        "question": question,
        "text": r["generated_text"] or "",
        "reasoning": r.get("reasoning") or "",  # shown folded: the answer is what counts
        "calls": _calls(r),
        "error": f"{r['error_stage']}: {r['error']}" if r["status"] != "ok" else "",
        "expected": str(r["expected"]) if r.get("expected") is not None else None,
        "metrics": " · ".join(filter(None, [made, _metrics(r)])),
        "scores": _scores(r),
    }


def _later_stages(
    path: Path, stages: list[tuple[str, Path]], by_id: dict[str, dict[str, Any]]
) -> list[ResultRow]:
    """A staged job's later stages' answers, each on the card of its row, and each row's
    entry of the stage its keep_if stopped it at marked; returns the job's rows."""
    for stage, results in stages:
        reader = asking(results_about(results))
        for r in read_results(results):
            card = by_id.get(id_key(r["id"]))
            if card is not None:
                card["entries"].append(_entry(r, reader.of(r)[0], "", stage))
                card["score"] = card["score"] if card.get("score") is not None else _score(r)
    rows = read_results(path)
    for r in rows:
        card = by_id.get(id_key(r["id"]))
        at = r.get("dropped_at")
        for entry in card["entries"] if card is not None and at is not None else []:
            here = entry["stage"] == at and entry["id"] == str(r["id"]) and entry["status"] == "ok"
            entry["stopped"] = entry["stopped"] or here  # a row the stage failed shows its error instead
    return rows


def _picture_keys(
    r: ResultRow,
    refs: Sequence[tuple[Ref, str]],
    from_job: dict[str, list[tuple[str, list[str]]]],
    thumbs: _Thumbs,
) -> list[str]:
    """The thumbnails' keys of a row's pictures: its media, else the job's pictures of it (a
    dataset's bytes the output does not carry), else its `url` column's."""
    keys = []
    for key, shown in from_job.get(id_key(r["id"]), []) if not refs else []:
        thumbs.setdefault(key, shown)
        keys.append(key)
    if not refs and not keys:
        url = next((r[c] for c in _URL_COLUMNS if isinstance(r.get(c), str)), "")
        refs = [(url, "image")] if url.startswith(("http://", "https://")) else []
    return keys + [thumbs.key(ref, kind) for ref, kind in refs]


def _card_id(row_id: object) -> str:
    """A card's name: a captioning run's file (`photos/a.png#1` → `photos/a.png`), else the id."""
    text = str(row_id)
    head, sep, tail = text.rpartition("#")
    return head if sep and tail.isdigit() else text


def write_gallery(
    path: Path, out: Path, media_base: Path | None = None, extra_columns: tuple[str, ...] = ()
) -> tuple[int, list[str], Path | None, list[str]]:
    """One page, one card per picture with every question asked of it and its answer (a row
    without media gets a card of its own), paged in the browser (100 cards at a time) so 10,000 rows
    stay light: local images are linked, not copied, and each embedded thumbnail is stored
    once however many rows share it. Relative media paths start where the run recorded the
    job's (`--media-base` overrides), and only files the run's media policy let it read are
    opened. Pictures come from the media columns (bytes too), then from the job for a dataset
    whose image bytes the output does not carry, then from a `url` column.
    A card whose picture was replaced since the run says so: its answers are the old picture's.
    A staged job's output shows each row's stages one under the other, and where it stopped.
    Returns (cards, media not found, where paths started: None for a remote job, pictures
    changed since the run)."""
    stages = list(staged(path).items())
    stage, first = stages[0] if stages else (None, path)
    rows = read_results(first)
    about = results_about(first)
    policy = media_policy(path, about, media_base)
    columns = media_columns(about, extra_columns)
    reader = asking(about, extra_columns)
    asked = [reader.of(r) for r in rows]
    media = [[(m.source, m.kind) for m in refs if m.kind != "audio"] for _, refs in asked]
    wanted = {id_key(r["id"]): r["input_hash"] for r, m in zip(rows, media, strict=True) if not m}
    from_job = _from_job(about, wanted, columns, policy)
    thumbs, changed = _Thumbs(policy, out.parent), Replaced(policy.path)
    cards: list[dict[str, Any]] = []
    by_media: dict[tuple[str, ...], dict[str, Any]] = {}
    by_id: dict[str, dict[str, Any]] = {}  # the card each row is on
    several = made_by(rows)
    made = [" · ".join(f"{c} {v[i]}" for c, v in several.items()) for i in range(len(rows))]
    for r, refs, (question, _), by in zip(rows, media, asked, made, strict=True):
        keys = _picture_keys(r, refs, from_job, thumbs)
        card = by_media.get(tuple(keys)) if keys else None
        if card is None:  # one card per picture (or set of them); a row without media, its own
            card = {"id": _card_id(r["id"]), "media": keys, "entries": []}
            cards.append(card)
            if keys:
                by_media[tuple(keys)] = card
        card["entries"].append(_entry(r, question, by, stage))
        by_id[id_key(r["id"])] = card
        for ref in changed.refs(r.get("media_files") or []):
            if ref not in card.setdefault("changed", []):
                card["changed"].append(ref)
        if card.get("score") is None:
            card["score"] = _score(r)
    if stages:
        rows = _later_stages(path, stages[1:], by_id)
    for card in cards:
        card["status"] = "ok" if all(e["status"] == "ok" for e in card["entries"]) else "error"
        card["rows"] = len({e["id"] for e in card["entries"]})
    missing = [key.split(":", 1)[1] for key, shown in thumbs.items() if not shown]
    data = {"cards": cards, "thumbs": thumbs, "page": _PAGE_CARDS}
    out.write_text(_PAGE.render(title=path.name, counts=_counts(rows, len(cards), len(stages)), data=data))
    return len(cards), missing, policy.base, sorted({ref for c in cards for ref in c.get("changed", [])})


def _counts(rows: list[ResultRow], cards: int, stages: int) -> str:
    """The page's headline: rows, cards, ok and failed; a staged job's stages and rows kept."""
    ok = sum(r["status"] == "ok" for r in rows)
    said = f"{len(rows)} rows on {cards} cards · {ok} ok · {len(rows) - ok} failed"
    if stages:
        said += f" · {stages} stages, {sum(r['dropped_at'] is None for r in rows)} rows through all"
    return said


_PAGE = jinja2.Environment(autoescape=True).from_string("""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchgen · {{ title }}</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;background:#fafafa;color:#222}
header{display:flex;gap:1.5em;align-items:center;flex-wrap:wrap;margin-bottom:1em}
#cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:10px}
.card.error{border:2px solid #c62828;background:#fff5f5}
.card img{max-width:160px;max-height:160px;margin:0 4px 4px 0;border-radius:4px}
.card div{overflow-wrap:anywhere}.id{font-weight:600}.rid{color:#777;font-size:.85em;margin-top:.6em}.q{color:#555;margin:.3em 0}.a{white-space:pre-wrap;margin:.3em 0}
.r{color:#777;font-size:12px}.err{color:#c62828}.m{color:#888;font-size:12px}.s{color:#1565c0;font-size:12px}.miss{color:#c62828}.hit{color:#2e7d32}
</style></head><body>
<header><h2 style="margin:0">{{ title }}</h2><span>{{ counts }}</span>
<label><input type="checkbox" id="failed"> failed rows only</label>
<label><input type="checkbox" id="byscore"> sort by score</label>
<span><button id="prev">&lsaquo;</button> <span id="pos"></span> <button id="next">&rsaquo;</button></span></header>
<div id="cards"></div>
<script id="data" type="application/json">{{ data|tojson }}</script>
<script>
const D = JSON.parse(document.getElementById("data").textContent);
let page = 0;
function rows() {
  let list = document.getElementById("failed").checked ? D.cards.filter(c => c.status !== "ok") : D.cards;
  if (document.getElementById("byscore").checked) list = [...list].sort((a, b) => (b.score ?? -Infinity) - (a.score ?? -Infinity));
  return list;
}
function el(tag, cls, text) { const e = document.createElement(tag); if (cls) e.className = cls; if (text) e.textContent = text; return e; }
function render() {
  const list = rows(), pages = Math.max(1, Math.ceil(list.length / D.page));
  page = Math.min(page, pages - 1);
  const box = document.getElementById("cards"); box.replaceChildren();
  for (const c of list.slice(page * D.page, (page + 1) * D.page)) {
    const card = el("div", "card" + (c.status === "ok" ? "" : " error")); card.dataset.status = c.status;
    for (const key of c.media) for (const src of D.thumbs[key] || []) { const img = el("img"); img.src = src; img.alt = key; card.append(img); }
    card.append(el("div", "id", c.id));
    if (c.changed) card.append(el("div", "err", "changed since the run: " + c.changed.join(", ") + " (these answers are the old picture's; rerun with --changed redo)"));
    for (const e of c.entries) {
      if (e.stage) card.append(el("div", "rid", e.stage + (c.rows > 1 ? " · " + e.id : "")));  // a staged job's stage
      else if (c.entries.length > 1) card.append(el("div", "rid", e.id));  // whose answer and score follow
      card.append(el("div", "q", e.question));
      if (e.reasoning) { const d = el("details", "r"); d.append(el("summary", "", "reasoning"), el("div", "a", e.reasoning)); card.append(d); }
      if (e.status === "ok") card.append(el("div", "a", e.text)); else card.append(el("div", "err", e.error));
      if (e.calls) card.append(el("div", "a", e.calls));
      if (e.expected !== null) { const ok = e.text.trim() === e.expected; card.append(el("div", ok ? "hit" : "miss", (ok ? "✓ expected " : "✗ expected ") + e.expected)); }
      if (e.scores) card.append(el("div", "s", e.scores));
      card.append(el("div", "m", e.metrics));
      if (e.stopped) card.append(el("div", "err", "stopped here: the stage's keep_if did not keep it"));
    }
    box.append(card);
  }
  document.getElementById("pos").textContent = `page ${page + 1} / ${pages}`;
  const imgs = [...box.querySelectorAll("img")];
  Promise.all(imgs.map(i => i.complete ? 0 : new Promise(r => { i.onload = i.onerror = r; }))).then(() => {
    document.body.dataset.cards = box.children.length;
    document.body.dataset.images = imgs.length;
    document.body.dataset.loaded = imgs.filter(i => i.naturalWidth > 0).length;
    document.body.dataset.failed = box.querySelectorAll(".card.error").length;
    document.body.dataset.rowIds = box.querySelectorAll(".rid").length;
  });
}
document.getElementById("failed").onchange = () => { page = 0; render(); };
document.getElementById("byscore").onchange = () => { page = 0; render(); };
document.getElementById("prev").onclick = () => { page = Math.max(0, page - 1); render(); };
document.getElementById("next").onclick = () => { page += 1; render(); };
render();
</script></body></html>
""")
