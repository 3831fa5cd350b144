#!/usr/bin/env python3
"""Copies of the bundled specs at another head_dim, for models whose heads are
not 128 wide (all-MiniLM-L6-v2: 32).

    python3 benches/fidelity/scale_specs.py --head-dim 32 --out target/fidelity/specs-d32

The rule keeps each format's per-channel budget and its shape:

- `head_dim` becomes the new width;
- `pca` `rank` and `bitmap` `keep` scale with it (rank d/4 stays d/4, rank
  d/2 stays d/2, 25 % of element pairs stays 25 %);
- everything else is unchanged: codebook and radius `group_size` (a codeword
  still covers as many channels, so bits per channel are the same), `bits`,
  scales, transforms, `[page]` and the `[cache]` policy.

Per-token and per-page overheads (an f16 scale per token, page headers,
tables) do not scale, so bytes per token are not exactly a quarter of the
128-wide spec's; `kvcc check` on the copies gives the exact numbers. The
script edits the TOML text (comments kept, a header added) and refuses a
value that would not scale to a whole number, or a group size that no longer
divides the new width.
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def scale(text, name, old, new):
    def scaled(match):
        value = int(match.group(2))
        if value * new % old:
            sys.exit(f"error: {name}: {match.group(1)} = {value} does not scale from {old} to {new}")
        return f"{match.group(1)} = {value * new // old}"

    text = re.sub(r"\b(rank|keep) = (\d+)", scaled, text)
    for size in re.findall(r"\bgroup_size = (\d+)", text):
        if new % int(size):
            sys.exit(f"error: {name}: group_size = {size} does not divide head_dim {new}")
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--specs", default=str(ROOT / "specs"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(args.specs).glob("*.toml")):
        text = path.read_text(encoding="utf-8")
        found = re.search(r"^head_dim = (\d+)$", text, re.M)
        if not found:
            sys.exit(f"error: {path}: no top-level `head_dim = N` line")
        old = int(found.group(1))
        body = scale(text, path.name, old, args.head_dim)
        body = body[: found.start()] + f"head_dim = {args.head_dim}" + body[found.end() :]
        header = (
            f"# Derived from specs/{path.name} at head_dim {args.head_dim} by "
            f"benches/fidelity/scale_specs.py:\n# pca ranks and bitmap keep scaled by "
            f"{args.head_dim}/{old}; group sizes, bits and [cache] unchanged.\n"
            f"# The comments below describe the head_dim-{old} original.\n"
        )
        (out / path.name).write_text(header + body, encoding="utf-8")
        print(out / path.name)


if __name__ == "__main__":
    main()
