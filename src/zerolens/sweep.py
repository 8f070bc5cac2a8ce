"""`zerolens sweep`: one verify run per (model, world size, reduce bucket size), tabulated side by side."""
from __future__ import annotations

from .report import markdown_table, mib


def point_summary(summary: dict, reduce_bucket_size: int, folder: str, preset: str) -> dict:
    """What the sweep keeps of one verify run: per strategy, the largest rank's figures (the rank
    holding the most gradient bytes), its prediction, and the losses."""
    strategies = {}
    for name, s in summary["strategies"].items():
        top = max(s["ranks"], key=lambda r: r["grad_bytes_after_backward"])
        peaks = [r["peak_bytes"] for r in s["ranks"] if r["peak_bytes"] is not None]
        step_times = [r["median_step_seconds"] for r in s["ranks"] if r.get("median_step_seconds") is not None]
        strategies[name] = {
            "grad_bytes_after_backward": top["grad_bytes_after_backward"],
            "predicted_grad_bytes_after_backward": top["predicted"]["grad_bytes_after_backward"],
            "grad_partition_elements": top["grad_partition_elements"],
            "param_bytes": top["param_bytes"], "optimizer_state_bytes": top["optimizer_state_bytes"],
            "comm_buffer_bytes_after_backward": top["comm_buffer_bytes_after_backward"],
            "activation_bytes_after_forward": top["activation_bytes_after_forward"],
            "peak_bytes": max(peaks) if peaks else None,
            # The slowest rank's median forward + backward + step time (verify's steps are measured,
            # so slower than `zerolens bench`'s; comparable between strategies and points).
            "step_time_s": max(step_times) if step_times else None,
            "losses": s["losses"], "seconds": s["seconds"],
        }
    return {"preset": preset, "params": summary["param_count"], "world_size": summary["world_size"],
            "reduce_bucket_size": reduce_bucket_size,
            "baseline": summary["baseline"],
            "device": summary["device"], "precision": summary["precision"], "verdict": summary["verdict"],
            "folder": folder, "strategies": strategies}


def render_sweep(points: list[dict], command: str, failed: list[str]) -> str:
    base_name = points[0]["baseline"]
    rows = []
    for p in points:
        base = p["strategies"][base_name]
        for name, s in p["strategies"].items():
            rows.append([p["preset"], p["world_size"], f"{p['reduce_bucket_size']:.0e}", name,
                         mib(s["grad_bytes_after_backward"]), mib(s["predicted_grad_bytes_after_backward"]),
                         f"{s['grad_bytes_after_backward'] / base['grad_bytes_after_backward']:.3f}",
                         f"{1 / p['world_size']:.3f}", mib(s["param_bytes"]), mib(s["optimizer_state_bytes"]),
                         mib(s["peak_bytes"]), "-" if s["step_time_s"] is None else f"{s['step_time_s'] * 1e3:.1f}",
                         f"{s['losses'][-1]:.4f}", p["verdict"]])
    table = markdown_table(["model", "N", "reduce bucket", "strategy", "grads after backward (largest rank)", "predicted",
                            f"vs {base_name}", "1/N", "params", "optimizer states", "peak (largest rank)",
                            "step (ms, median)", "last loss", "verify"], rows)
    missing = f"\nFailed points (see their run folders): {', '.join(failed)}\n" if failed else ""
    return f"""# zerolens sweep

Command: `{command}`. One `zerolens verify` per row group; each point's folder holds its own
report. Memory in MiB (1024^2 bytes), per rank, the rank holding the most gradient bytes. Step time:
forward + backward + step, median over verify's steps but the first and the last, slowest rank
(verify measures every step: use `zerolens bench` for throughput).
{missing}
{table}
"""
