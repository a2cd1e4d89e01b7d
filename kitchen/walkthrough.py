"""A printed tour of the constitution stage: load, personalise, compare, cache, redact.

The first line of the loop's data flow (profile → redact → personalise → personal
constitution; docs/method.md#personalisation), as text: `kitchen constitution tour` prints it.

`kitchen demo` prints it; the notebook `01_constitution.py` shows the same steps interactively.
"""

from __future__ import annotations

from kitchen import paths
from kitchen.constitution import (
    PersonalizationCache,
    load_constitution,
    render_diff,
    render_text,
)
from kitchen.profile import load_profiles, redact


def constitution_walkthrough(
    constitution_path: str | None = None, profiles_dir: str | None = None
) -> str:
    """Return the tour as text (no PII in it: every profile is redacted before use)."""
    c = load_constitution(constitution_path or paths.DEFAULT_CONSTITUTION)
    profiles = load_profiles(profiles_dir or paths.PROFILES)
    out = [
        f"== 1. The constitution: {c.name}@{c.version}",
        f"{len(c.axioms)} axioms (red lines) and {len(c.theorems)} theorems derived from them.",
    ]
    for t in c.theorems:
        out.append(f"  {t.id} <- {', '.join(t.derives_from)}  when {t.condition_text()}: {t.text}")

    cache = PersonalizationCache()
    pcs = [cache.get(c, p) for p in profiles]
    a, b = pcs[0], pcs[1]
    out += [
        "",
        f"== 2. Personalised for {a.profile} (redacted; {len(profiles)} profiles loaded)",
        render_text(a),
    ]
    if a.fallbacks:
        out.append(
            "Fallbacks: "
            + "; ".join(f"{f.dimension} -> {f.used} ({f.reason})" for f in a.fallbacks)
        )
    out += ["", f"== 3. What changes for {b.profile}", render_diff(a, b)]
    shaky = [pc for pc in pcs if any("confidence" in f.reason for f in pc.fallbacks)]
    out += ["", f"== 4. Low-confidence profiles: {len(shaky)} of {len(pcs)} fall back to defaults"]
    for pc in shaky[:3]:
        out.append(
            f"  {pc.profile}: "
            + "; ".join(f"{f.dimension} -> {f.used} ({f.reason})" for f in pc.fallbacks)
        )
    for p in profiles:
        cache.get(c, p)
    out += [
        "",
        f"== 5. Cache: {len(cache)} entries, {cache.hits} hits, {cache.misses} misses "
        "(the second pass hit every entry)",
    ]
    masked = sum(redact(p).masked for p in profiles)
    notes = sum(p.notes is not None for p in profiles)
    out += [
        "",
        f"== 6. Privacy: name, phone, e-mail and address dropped from all {len(profiles)} "
        f"profiles, {notes} free-text notes dropped, {masked} identifiers masked inside values; "
        "ids replaced by keyed-hash pseudonyms",
    ]
    return "\n".join(out)
