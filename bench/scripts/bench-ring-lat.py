#!/usr/bin/env python3
"""The sleeping consumer's one-way latency, ringmux's ring beside the C reference's, two ways.

The C reference forwarder's `bench ring mode=lat cons=sleep` records, per look that found data,
the latency of the newest message only. A late wake-up hides there: by the time the consumer
runs, newer messages have arrived, and the newest is young. ringmux's ring bench records every
message (`lat_*`) and, for the comparison, the newest per look as the C reference does
(`newest_*`). This script builds the C reference twice, as shipped and with its consumer
recording every message (one loop added by a checked text substitution of its source), and runs
the three side by side in interleaved rounds, printing medians and ringmux / C ratios of each
measure.

Usage: bench/scripts/bench-ring-lat.py --reference DIR [--rounds 3] [--seconds 2] [--interval-us 20]
DIR holds the C reference's bench.c. Needs gcc and cargo; run as root for SCHED_FIFO, as both
benches ask for it (otherwise both run on the normal scheduler).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

# The C reference consumer's latency sample (the newest slot, h - 1) and what replaces it: the
# same sample for every slot from tail to h.
C_NEWEST = """      if (lat && h != tail) { uint64_t t = now_ns(); struct slot *s = ring_slot(r, h - 1);
        if (atomic_load_explicit(&C->phase, memory_order_relaxed) == 1) { uint64_t k = atomic_fetch_add(nlat, 1); if (k < maxs) lats[k] = (uint32_t)(t - s->ts); } }"""
C_EVERY = """      if (lat && h != tail) { uint64_t t = now_ns(); for (uint64_t q = tail; q != h; q++) { struct slot *s = ring_slot(r, q);
        if (atomic_load_explicit(&C->phase, memory_order_relaxed) == 1) { uint64_t k = atomic_fetch_add(nlat, 1); if (k < maxs) lats[k] = (uint32_t)(t - s->ts); } } }"""

QUANTILES = ["p50", "p99", "p999", "max"]


def fields(line):
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def res_line(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    lines = [l for l in out.splitlines() if l.startswith("RES ")]
    if not lines:
        sys.exit(f"no RES line from {' '.join(cmd)}:\n{out}")
    return fields(lines[-1])


def build(reference, tmp):
    src = os.path.join(reference, "bench.c")
    if not os.path.isfile(src):
        sys.exit(f"--reference {reference}: no bench.c there (give the C reference's folder)")
    text = open(src).read()
    if C_NEWEST not in text:
        sys.exit(f"{src}: the consumer's latency sample is not the one this script knows how to "
                 "change; compare the two by hand")
    every = os.path.join(tmp, "bench-every.c")
    open(every, "w").write(text.replace(C_NEWEST, C_EVERY))
    bins = {}
    for name, path in [("c_newest", src), ("c_every", every)]:
        out = os.path.join(tmp, name)
        subprocess.run(["gcc", "-O2", "-o", out, path, "-lm"], check=True)
        bins[name] = out
    cargo = subprocess.run(
        ["cargo", "bench", "-p", "ringmux-ring", "--bench", "ring", "--no-run"],
        capture_output=True, text=True, check=True)
    m = re.search(r"Executable benches/ring\.rs \(([^)]+)\)", cargo.stderr)
    if not m:
        sys.exit(f"could not find the ring bench's executable in cargo's output:\n{cargo.stderr}")
    bins["ringmux"] = m.group(1)
    return bins


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True, help="folder holding the C reference's bench.c")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--interval-us", type=int, default=20,
                    help="the producer's interval (the ring bench's is fixed at 20)")
    a = ap.parse_args()
    if a.interval_us != 20:
        sys.exit("--interval-us: the ring bench publishes every 20 µs; only 20 compares")
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    with tempfile.TemporaryDirectory() as tmp:
        bins = build(a.reference, tmp)
        c_args = ["ring", "mode=lat", "cons=sleep", f"interval_us={a.interval_us}",
                  f"dur={a.seconds}"]
        rows = []  # (round, measure, impl, {quantile: µs})
        for rnd in range(1, a.rounds + 1):
            newest = res_line([bins["c_newest"]] + c_args)
            every = res_line([bins["c_every"]] + c_args)
            ours = res_line([bins["ringmux"], "--mode", "lat-sleep", "--seconds", str(a.seconds)])
            got = [
                ("newest", "C", {q: int(newest[f"lat_{q}_ns"]) / 1000 for q in QUANTILES}),
                ("newest", "ringmux", {q: int(ours[f"newest_{q}_ns"]) / 1000 for q in QUANTILES}),
                ("every", "C", {q: int(every[f"lat_{q}_ns"]) / 1000 for q in QUANTILES}),
                ("every", "ringmux", {q: int(ours[f"lat_{q}_ns"]) / 1000 for q in QUANTILES}),
            ]
            for measure, impl, v in got:
                rows.append((rnd, measure, impl, v))
                print(f"round {rnd} {measure:6} {impl:7} " +
                      "  ".join(f"{q} {v[q]:8.1f} µs" for q in QUANTILES), flush=True)

    def med(xs):
        return statistics.median(xs)

    print(f"\nSleeping consumer, one message every {a.interval_us} µs, {a.rounds} interleaved "
          f"rounds of {a.seconds} s: median (min–max) in µs, and ringmux / C within each round\n")
    print("| measure | impl | " + " | ".join(QUANTILES) + " |")
    print("|---|---|" + "---|" * len(QUANTILES))
    for measure in ["newest", "every"]:
        for impl in ["C", "ringmux"]:
            cells = []
            for q in QUANTILES:
                xs = [v[q] for _, m, i, v in rows if m == measure and i == impl]
                cells.append(f"{med(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})")
            print(f"| {measure} | {impl} | " + " | ".join(cells) + " |")
        cells = []
        for q in QUANTILES:
            rs = []
            for rnd in range(1, a.rounds + 1):
                c = [v[q] for r, m, i, v in rows if r == rnd and m == measure and i == "C"][0]
                o = [v[q] for r, m, i, v in rows if r == rnd and m == measure and i == "ringmux"][0]
                rs.append(o / c if c else float("nan"))
            cells.append(f"{med(rs):.2f} ({min(rs):.2f}–{max(rs):.2f})")
        print(f"| {measure} | ringmux / C | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
