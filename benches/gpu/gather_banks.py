#!/usr/bin/env python3
"""Shared-memory wavefronts per gathering load of MosaicKV's tensor-core kernel.

Simulates the kernel's gathered loads (skeleton/gather.rs) on fresh random
masks (16 of 64 f16 pairs kept per row, as the encoder keeps them) and counts
the wavefronts each warp-wide load needs: per bank, its distinct words. Rows
are 72 bytes (an 8-byte mask, then the kept pairs by rank), unpadded, as bulk
copies leave them. Layouts compared (`strided` and `adjacent` are the
kernel's):

- keys: lane (g, t) of a load reads row g of the half-tile; `contiguous`:
  quad lane t owns groups 16t..16t+15, `strided`: mask bytes t and t + 4,
  `interleaved`: groups 4r + t;
- values: lane (g, t) reads its lane group g's byte of the mask (groups
  8g..8g+7) of one of its tokens; `every-other`: tokens 2t + {0, 1, 8, 9},
  `adjacent`: t + {0, 8, 4, 12}.

Usage: gather_banks.py [--tiles N] [--seed S]
"""
import argparse
import random

ROW_WORDS = 18  # 72-byte rows
MASK_WORDS = 2
PAIRS, KEPT = 64, 16


def wavefronts(words):
    per_bank = {}
    for word in set(words):
        per_bank[word % 32] = per_bank.get(word % 32, 0) + 1
    return max(per_bank.values(), default=1)


def address(masks, row, pair):
    """The word a lane loads for `pair` of `row`, or None when not kept."""
    mask = masks[row]
    if not mask[pair]:
        return None
    return ROW_WORDS * row + MASK_WORDS + sum(mask[:pair])


def key_loads(masks, owner):
    for half in range(2):
        for register in range(16):
            yield [address(masks, 8 * half + g, owner(t, register)) for g in range(8) for t in range(4)]


def value_loads(masks, tokens):
    for k in range(4):
        for j in range(8):
            yield [address(masks, tokens(t, k), 8 * g + j) for t in range(4) for g in range(8)]


def mean_wavefronts(tiles, loads):
    counts = [wavefronts([w for w in load if w is not None]) for masks in tiles for load in loads(masks)]
    return sum(counts) / len(counts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=300, help="16-token tiles simulated")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    def row():
        kept = set(rng.sample(range(PAIRS), KEPT))
        return [p in kept for p in range(PAIRS)]

    tiles = [[row() for _ in range(16)] for _ in range(args.tiles)]
    layouts = [
        ("keys, contiguous groups", lambda m: key_loads(m, lambda t, r: 16 * t + r)),
        ("keys, strided runs", lambda m: key_loads(m, lambda t, r: 32 * (r // 8) + 8 * t + r % 8)),
        ("keys, interleaved groups", lambda m: key_loads(m, lambda t, r: 4 * r + t)),
        ("values, every-other rows", lambda m: value_loads(m, lambda t, k: 2 * t + [0, 1, 8, 9][k])),
        ("values, adjacent rows", lambda m: value_loads(m, lambda t, k: t + [0, 8, 4, 12][k])),
    ]
    print(f"{'layout':<26} wavefronts per load (ideal 1)")
    for name, loads in layouts:
        print(f"{name:<26} {mean_wavefronts(tiles, loads):.3f}")


if __name__ == "__main__":
    main()
