"""Markdown tables from the results.json that tools/gpu/run_allreduce_tests.sh writes.

Hand-written so that the run that is still missing (2/4/8 GPUs) turns into the same
tables as the single-GPU runs with one command:
    python3 tools/gpu/allreduce_report.py results.json > tables.md
"""
import json
import sys


def size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def us(x) -> str:
    return "n/a" if x is None or x != x else f"{x:.1f}"


def verification(r: dict) -> list:
    out = ["| run | ranks | what | result |", "| --- | --- | --- | --- |"]
    for key in sorted(r):
        d = r[key]
        if key.startswith("sim_W"):
            c, g = d.get("correctness", {}), d.get("graph", {})
            if c:
                out.append(f"| {key} | {d['world']} on 1 GPU | eager: {c['runs']} all-reduces, fresh random data "
                           f"| ok={c['ok']}, worst err/bound {c['summary']['worst_err_over_tol']:.3f}, "
                           f"NaN left {c['summary']['nans']} |")
            if g:
                rb = g["replay_before_register"]
                items = g["replays"]["items"]
                out.append(f"| {key} | {d['world']} on 1 GPU | graph: {g['replays']['count']} replays x "
                           f"{len(items)} all-reduces, inputs rewritten before each; replay before registration "
                           f"| ok={g['ok']}, worst err/bound {max(i['worst_err_over_tol'] for i in items):.3f}, "
                           f"unregistered replay flagged={rb['ok']} |")
        elif key.startswith("dist_"):
            if "blocked" in d:
                out.append(f"| {key} | {d['world']} | blocked | {d['blocked']} |")
                continue
            c, g = d.get("correctness", {}), d.get("graph", {})
            gpus = f"{d['world']} process(es) on {d['gpus']} GPU(s)"
            vs = c.get("max_diff_vs_nccl_in_ulps")
            out.append(f"| {key} | {gpus} | eager: {c.get('checks')} all-reduces vs "
                       f"{'NCCL' if d['backend'] == 'nccl' else 'gloo (CPU) float64 sum'} "
                       f"| ok={c.get('ok')}, worst err/bound {c.get('worst_err_over_tol', float('nan')):.3f}"
                       + (f", max diff vs NCCL (ulps) {vs}" if vs else "") + " |")
            if g:
                out.append(f"| {key} | {gpus} | graph, buffers registered through the IPC exchange: {g['replays']} replays x "
                           f"{len(g['items'])} all-reduces | ok={all(i['ok'] for i in g['items'])}, "
                           f"device errors {g['device_errors'] or 'none'} |")
    return out


def nccl_table(rows: list, title: str) -> list:
    out = [f"**{title}**", "", "| size | custom eager (us) | NCCL eager (us) | custom graph (us) | NCCL graph (us) |",
           "| --- | --- | --- | --- | --- |"]
    for row in rows:
        out.append(f"| {size(row['bytes'])} | {us(row['custom_eager_us'])} | {us(row['nccl_eager_us'])} | "
                   f"{us(row['custom_graph_us'])} | {us(row['nccl_graph_us'])} |")
    return out


def sim_table(r: dict) -> list:
    worlds = [w for w in (1, 2, 4, 8) if f"bench_sim_W{w}" in r]
    head = "| size | " + " | ".join(f"W={w} in graph (us)" for w in worlds) + " | copy kernel in graph (us) |"
    out = [head, "| --- |" + " --- |" * (len(worlds) + 1)]
    rows = {w: r[f"bench_sim_W{w}"]["bench"] for w in worlds}
    for i, row in enumerate(rows[worlds[0]]):
        cells = [us(rows[w][i]["custom_in_graph_x10_us"]) for w in worlds]
        out.append(f"| {size(row['bytes'])} | " + " | ".join(cells) + f" | {us(row.get('local_copy_in_graph_x10_us'))} |")
    return out


def main(path: str) -> None:
    r = json.load(open(path))
    print("\n".join(verification(r)))
    for key in sorted(k for k in r if k.startswith("dist_nccl") and "bench" in r[k]):
        print()
        print("\n".join(nccl_table(r[key]["bench"], f"{key}: bf16, {r[key]['world']} rank(s), {r[key]['device']}")))
    if any(k.startswith("bench_sim") for k in r):
        print()
        print("\n".join(sim_table(r)))


if __name__ == "__main__":
    main(sys.argv[1])
