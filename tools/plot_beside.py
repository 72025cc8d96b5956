"""Plots a bench/vllm_worker.py result: per layout, each source's GB/s beside the model
against the step slowdown it costs, one marker per direction (needs matplotlib).

  python3 tools/plot_beside.py --results=bench/results/<file>.json --out=<file>.png
"""

import json

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("results", None, "A bench/vllm_worker.py JSON file.", required=True)
flags.DEFINE_string("out", None, "The PNG to write.", required=True)
flags.DEFINE_string("where", "", "Only rows with this key=value (for example wheel=606b7c7).")

MARKERS = {"store": "v", "load": "^", "both": "D"}
LABELS = {"bulk": "bulk copies", "vllm_worker": "vLLM's worker"}


def main(argv):
    del argv
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(FLAGS.results) as f:
        rows = [r for r in json.load(f)["rows"] if "step_slowdown" in r]
    if FLAGS.where:
        key, value = FLAGS.where.split("=", 1)
        rows = [r for r in rows if str(r.get(key)) == value]
    if not rows:
        raise app.UsageError(f"--results: no rows beside the loop in {FLAGS.results}"
                             + (f" with {FLAGS.where}" if FLAGS.where else ""))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.5), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    for ax, layout in zip(axes[0], layouts):
        for r in (r for r in rows if r["layout"] == layout):
            chosen = r["method"] in r["chosen"].split("/")
            ax.scatter(100 * r["step_slowdown"], r["gb_per_s_beside"], color=colors[r["method"]],
                       marker=MARKERS[r["direction"]], s=60 if chosen else 30,
                       edgecolors="black" if chosen else "none")
        ax.set_title(layout)
        ax.set_xlabel("model step slowdown (%)")
        ax.set_ylabel("GB/s beside the model")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[m], marker="o", linestyle="", label=LABELS.get(m, m))
               for m in methods]
    handles += [plt.Line2D([], [], color="gray", marker=k, linestyle="", label=d) for d, k in MARKERS.items()]
    handles.append(plt.Line2D([], [], color="white", marker="o", markeredgecolor="black", linestyle="",
                              label="kvoffload's default"))
    fig.legend(handles=handles, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(FLAGS.out, dpi=110)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
