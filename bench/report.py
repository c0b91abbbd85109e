"""Printing: the side-by-side table, the long-stream table, the memory checks and the targets."""

from __future__ import annotations

from statistics import median

from load import Result
from measure import NAMES, Cell, LongRow, PacedRow
from soak import RssResult, SlowResult
from workloads import Workload

Row = tuple[Workload, int, Cell]


def _ratio(a: float, b: float, fmt: str = "{:.2f}") -> str:
    return fmt.format(a / b) if b > 0 else "–"


PAIRED_AT_LEAST = 3  # pairs (rounds of --repeat) before their median is what a target is judged on


def _paired(best: str, pairs: list[float]) -> str:
    """A best-of-each ratio, and with --repeat the median of the rounds' pairs beside it."""
    return f"{best} (paired {median(pairs):.2f}, {min(pairs):.2f}–{max(pairs):.2f})" if pairs else best


def kiln_over_bare(kiln: Result, bare: Result) -> tuple[float, str]:
    """Kiln's rps over the bare proxy's as a target judges it: the median of the rounds' pairs when
    there are enough of them (each pair shares one spell of the machine), else best over best."""
    best = kiln.rps / bare.rps
    if len(kiln.paired_rps) >= PAIRED_AT_LEAST:
        middle = median(kiln.paired_rps)
        return middle, f"{middle:.2f} (median of {len(kiln.paired_rps)} pairs; best over best {best:.2f})"
    return best, f"{best:.2f}"


def main_table(rows: list[Row], targets: list[str]) -> tuple[str, list[str]]:
    """The markdown table and its footnotes (why a cell is n/a)."""
    head = ("| protocol | workload | c | target | rps | p50 ms | p99 ms | added p50 ms | CPU µs/req "
            "| Kiln/bare rps | Kiln/bare capacity | Kiln/bare added p50 | Kiln/LiteLLM rps |")
    lines = [head, "|---|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    notes: list[str] = []
    for w, c, cell in rows:
        direct = cell.get("direct")
        d50 = direct.p50_ms if isinstance(direct, Result) else None
        for target in targets:
            res = cell.get(target)
            start = f"| {w.protocol} | {w.name} | {c} | {NAMES[target]} |"
            if not isinstance(res, Result):
                if res not in notes:
                    notes.append(str(res))
                lines.append(f"{start} n/a [{notes.index(str(res)) + 1}] | | | | | | | | |")
                continue
            added = f"{res.p50_ms - d50:+.2f}" if d50 is not None and target != "direct" else "–"
            ratios = " | | | |"
            if target == "kiln":
                bare, lite = cell.get("bare"), cell.get("litellm")
                r_bare = _paired(_ratio(res.rps, bare.rps), res.paired_rps) if isinstance(bare, Result) else "–"
                r_cap = _paired(_ratio(bare.cpu_us, res.cpu_us), res.paired_cpu) if isinstance(bare, Result) else "–"
                r_added = (_ratio(res.p50_ms - d50, bare.p50_ms - d50, "{:.2f}×")
                           if isinstance(bare, Result) and d50 is not None else "–")
                r_lite = _ratio(res.rps, lite.rps, "{:.1f}×") if isinstance(lite, Result) else "–"
                ratios = f" {r_bare} | {r_cap} | {r_added} | {r_lite} |"
            lines.append(f"{start} {res.rps:,.0f} | {res.p50_ms:.2f} | {res.p99_ms:.2f} | {added} | "
                         f"{res.cpu_us:,.0f} |{ratios}")
    return "\n".join(lines), notes


def long_table(rows: list[LongRow], tolerance: float = 0.10) -> tuple[str, dict[tuple[str, str], bool]]:
    """CPU per output token by stream length. The cost of a token must not grow with the length
    of the stream: OK when the per-token increment 8k→32k is at most `tolerance` above the
    increment 20→8k (a quadratic cost shows as a growing increment; the raw µs/token at 20
    tokens is mostly the per-request cost)."""
    lengths = sorted({r.tokens for r in rows})
    by = {(r.protocol, r.target, r.tokens): r for r in rows}
    head = ("| protocol | target | " + " | ".join(f"µs/token @{n}" for n in lengths)
            + f" | ms/stream @{lengths[-1]} | increment µs/token {lengths[0]}→{lengths[1]} "
            f"| increment {lengths[1]}→{lengths[2]} | constant per token (≤ +{tolerance:.0%}) |")
    lines = [head, "|---|---|" + "--:|" * (len(lengths) + 3) + "---|"]
    verdicts: dict[tuple[str, str], bool] = {}
    for protocol, target in dict.fromkeys((r.protocol, r.target) for r in rows):
        cells = [by.get((protocol, target, n)) for n in lengths]
        if any(c is None for c in cells) or len(lengths) < 3:
            continue
        a, m, z = cells  # type: ignore[misc]
        first = (m.cpu_ms_per_stream - a.cpu_ms_per_stream) * 1000 / (m.tokens - a.tokens)
        second = (z.cpu_ms_per_stream - m.cpu_ms_per_stream) * 1000 / (z.tokens - m.tokens)
        ok = first > 0 and second <= (1 + tolerance) * first
        verdicts[(protocol, target)] = ok
        per_token = " | ".join(f"{c.cpu_us_per_token:.2f}" for c in cells)  # type: ignore[union-attr]
        lines.append(f"| {protocol} | {NAMES[target]} | {per_token} | {z.cpu_ms_per_stream:,.1f} | {first:.2f} "
                     f"| {second:.2f} | {'OK' if ok else 'GROWS'} ({second / first - 1 if first > 0 else 0:+.0%}) |")
    return "\n".join(lines), verdicts


def paced_table(rows: list[PacedRow]) -> str:
    """CPU per output token at a model server's pace, each target beside the bare proxy."""
    by = {(r.protocol, r.target): r for r in rows}
    targets = list(dict.fromkeys(r.target for r in rows))
    lines = ["| protocol | " + " | ".join(f"{NAMES[t]} µs/token" for t in targets) + " | Kiln / bare proxy |",
             "|---|" + "--:|" * (len(targets) + 1)]
    for protocol in dict.fromkeys(r.protocol for r in rows):
        cells = [by.get((protocol, t)) for t in targets]
        kiln, bare = by.get((protocol, "kiln")), by.get((protocol, "bare"))
        ratio = f"{kiln.cpu_us_per_token / bare.cpu_us_per_token:.2f}×" if kiln and bare else "–"
        lines.append(f"| {protocol} | " + " | ".join(f"{c.cpu_us_per_token:.2f}" if c else "n/a" for c in cells)
                     + f" | {ratio} |")
    return "\n".join(lines)


def first_token_table(rows: dict[str, dict[str, float | str]], limit_ms: float = 1.0) -> list[str]:
    """Per protocol: each target's time to the first text chunk, and Kiln's added time vs the target."""
    targets = list(next(iter(rows.values()), {}))
    lines = ["| protocol | " + " | ".join(NAMES[t] for t in targets) + f" | Kiln added ≤ {limit_ms:g} ms |",
             "|---|" + "--:|" * len(targets) + "---|"]
    for protocol, row in rows.items():
        direct = row.get("direct")
        cells = []
        for t in targets:
            v = row[t]
            if not isinstance(v, float):
                cells.append("n/a")
            elif t == "direct" or not isinstance(direct, float):
                cells.append(f"{v:.2f}")
            else:
                cells.append(f"{v:.2f} ({v - direct:+.2f})")
        kiln = row.get("kiln")
        verdict = ("OK" if kiln - direct <= limit_ms else "MISS") if isinstance(kiln, float) and isinstance(direct, float) else "–"
        lines.append(f"| {protocol} | " + " | ".join(cells) + f" | {verdict} |")
    return lines


def slow_lines(s: SlowResult, limit_mb: float = 300.0) -> list[str]:
    """The slow-stream check's lines; `limit_mb` in MB (10^6 bytes), as the target says, against
    RSS read in MiB."""
    peak_mb = s.peak_rss_mb * 1.048576
    ok = s.completed == s.n and s.peak_open == s.n and peak_mb <= limit_mb
    body = ", 60 KB agent bodies" if s.body == "agent" else ""
    gateway = "gateway" if s.workers == 1 else f"gateway ({s.workers} workers and their parent, summed)"
    files = "" if s.workers == 1 else " in one worker"
    out = [f"- many slow streams ({s.protocol}{body}, one token a second): {s.completed:,} of {s.n:,} complete in "
           f"{s.seconds:.0f} s (all opened in {s.open_s:.0f} s); up to {s.peak_open:,} open at once at the client, "
           f"{s.upstream_peak:,} at the simulator; {gateway} RSS idle "
           f"{s.idle_rss_mb:.0f} MiB, peak {s.peak_rss_mb:.0f} MiB = {peak_mb:.0f} MB ({s.kb_per_stream:.0f} KiB per "
           f"stream); ledger {s.metered:,} events; open files up to {s.peak_fds:,}{files} (limit {s.fd_limit:,}"
           f"{' each' if s.workers > 1 else ''}); "
           f"{'OK' if ok else 'MISS'} (all open at once, all complete, peak ≤ {limit_mb:.0f} MB)"]
    if s.bare is not None:
        t = s.bare
        out.append(f"  - the bare proxy, the same streams: {t.completed:,} of {t.n:,} complete, up to {t.peak_open:,} "
                   f"open at once; RSS idle {t.idle_rss_mb:.0f} MiB, peak {t.peak_rss_mb:.0f} MiB "
                   f"({t.kb_per_stream:.0f} KiB per stream; Kiln / bare {s.kb_per_stream / max(t.kb_per_stream, 0.1):.2f}×)")
    if s.peak_open < s.completed:
        out.append(f"  - only {s.peak_open:,} of {s.n:,} were open at once: the first ended before the last opened "
                   "(a busy gateway opens them slowly; lengthen them with --slow-tokens)")
    if s.problems:
        out.append("  - failures: " + "; ".join(f"{n}× {p}" for p, n in s.problems.items()))
    if s.fd_exhausted or s.peak_fds >= s.fd_limit - 16:
        out.append(f"  - the gateway ran out of file descriptors (limit {s.fd_limit:,}; each stream takes two: raise "
                   "the limit with --gateway-nofile, or spread the streams over --slow-workers)")
    return out


def rss_lines(r: RssResult, tolerance: float = 0.05) -> list[str]:
    values = [rss for _, rss in r.samples]
    ok = r.max_deviation <= tolerance
    step = max(1, len(r.samples) // 8)
    trace = ", ".join(f"{done:,}: {rss:.1f}" for done, rss in r.samples[::step] + r.samples[-1:])
    return [f"- RSS over {r.requests:,} requests (c={r.concurrency}, every protocol, JSON and streaming, "
            f"{r.requests / r.seconds if r.seconds else 0:,.0f} rps): baseline {r.baseline:.1f} MiB after {r.start:,} requests (10%, and 90 s of rate windows), "
            f"min {min(values):.1f}, max {max(values):.1f}, last {values[-1]:.1f}; largest deviation "
            f"{r.max_deviation:+.1%}: {'OK' if ok else 'MISS'} (flat within ±{tolerance:.0%})",
            f"  - samples (requests: MiB): {trace}"]


def targets(rows: list[Row]) -> list[str]:
    """The issue's targets that this run's cells can judge, each with its value and OK / MISS."""
    cells = {(w.protocol, w.name, c): cell for w, c, cell in rows}
    out: list[str] = []

    def get(protocol: str, name: str, c: int, target: str) -> Result | None:
        res = cells.get((protocol, name, c), {}).get(target)
        return res if isinstance(res, Result) else None

    def judge(label: str, value: float | None, ok: bool, shown: str) -> None:
        if value is not None:
            out.append(f"{label}: {shown} {'OK' if ok else 'MISS'}")

    chat_ratio = None
    for protocol in ("chat", "completions", "responses", "messages"):
        k, b, lt = (get(protocol, "json", 64, t) for t in ("kiln", "bare", "litellm"))
        if k and b:
            ratio, shown = kiln_over_bare(k, b)
            chat_ratio = ratio if protocol == "chat" else chat_ratio
            if protocol == "chat":
                judge("non-stream chat c=64 Kiln/bare rps ≥ 0.85", ratio, ratio >= 0.85, shown)
            elif chat_ratio:
                drift = ratio / chat_ratio - 1
                judge(f"non-stream {protocol} c=64 Kiln/bare within 15% of chat's", ratio, abs(drift) <= 0.15,
                      f"{shown} ({drift:+.0%})")
        if protocol == "chat" and k and lt:
            judge("non-stream chat c=64 Kiln/LiteLLM rps ≥ 40×", k.rps, k.rps / lt.rps >= 40, f"{k.rps / lt.rps:.1f}×")
        d, k1, b1 = (get(protocol, "json", 1, t) for t in ("direct", "kiln", "bare"))
        if d and k1 and b1 and b1.p50_ms > d.p50_ms:
            r50 = (k1.p50_ms - d.p50_ms) / (b1.p50_ms - d.p50_ms)
            judge(f"non-stream {protocol} c=1 added p50 ≤ 1.3× bare's", r50, r50 <= 1.3, f"{r50:.2f}×")
            if b1.p99_ms > d.p99_ms:
                r99 = (k1.p99_ms - d.p99_ms) / (b1.p99_ms - d.p99_ms)
                judge(f"non-stream {protocol} c=1 added p99 ≤ 1.3× bare's", r99, r99 <= 1.3, f"{r99:.2f}×")
        ks, bs = get(protocol, "stream", 64, "kiln"), get(protocol, "stream", 64, "bare")
        if ks and bs:
            ratio, shown = kiln_over_bare(ks, bs)
            judge(f"stream {protocol} c=64 Kiln/bare streams/s ≥ 0.8", ratio, ratio >= 0.8, shown)
    k, b = get("chat", "json", 64, "kiln"), get("chat", "json", 64, "bare")
    if k and b:
        ratio, shown = kiln_over_bare(k, b)
        judge("stretch: non-stream chat c=64 Kiln/bare ≥ 1.0", ratio, ratio >= 1.0, shown)
    return out
