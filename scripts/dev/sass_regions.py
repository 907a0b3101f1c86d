"""A kernel's SASS instructions executed outside its main loop, from ncu's source counters:

    ncu --section SourceCounters -k regex:flash_mma --launch-skip 2 --launch-count 1 \
        -o report python3 scripts/dev/profile_one.py 64 4096 float16 mma False
    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/dev/sass_regions.py sass.csv --warps 16384 [--loop 20]

--warps: the launch's warps (blocks x 4 for flash_mma), so that an instruction each warp
executes once counts 1. An instruction executed at least --loop times a warp is the key loop's;
the others, in runs of consecutive addresses, are the block's fixed work (prologue, epilogue,
the masked tiles of a causal band). Prints each run's instructions a warp, its stall samples,
and its commonest opcodes.
"""
import argparse
import collections
import csv


def opcode(source):
    words = source.split()
    return words[1] if words[0].startswith("@") else words[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--warps", type=int, required=True)
    ap.add_argument("--loop", type=float, default=20)
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    head = rows.index(next(r for r in rows if r and r[0] == "Address"))
    cols = rows[head]
    executed, samples = cols.index("Instructions Executed"), cols.index(
        "Warp Stall Sampling (All Samples)")
    body = [(r[1], int(r[executed]), int(r[samples])) for r in rows[head + 1:] if len(r) > samples]
    total, all_samples = sum(b[1] for b in body), sum(b[2] for b in body)
    runs, last = [], None
    for i, (source, n, s) in enumerate(body):
        if n >= a.loop * a.warps:
            continue
        if last is None or i != last + 1:
            runs.append([i, i, 0, 0, collections.Counter()])
        run = runs[-1]
        run[1], run[2], run[3] = i, run[2] + n, run[3] + s
        run[4][opcode(source)] += 1
        last = i
    outside = sum(r[2] for r in runs)
    print(f"{total} instructions, {outside / a.warps:.0f} a warp outside the loop "
          f"({100 * outside / total:.1f}%); stall samples outside "
          f"{100 * sum(r[3] for r in runs) / max(all_samples, 1):.1f}%")
    for first, end, n, s, ops in sorted(runs, key=lambda r: -r[2])[:8]:
        print(f"  SASS {first:5d}-{end:5d}: {n / a.warps:7.0f} a warp, {s:6d} samples, "
              f"{ops.most_common(5)}")


if __name__ == "__main__":
    main()
