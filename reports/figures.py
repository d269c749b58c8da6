"""The report's figures: matplotlib (Agg, headless) drawings of polars frames read from the catalog.

Each function takes the rows it draws and returns a Figure; nothing here queries storage.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
from matplotlib.axes import Axes
from matplotlib.figure import Figure

CLASS_COLOURS = {"diagonal": "tab:blue", "psd_diagonal": "tab:cyan", "lowrank": "tab:red",
                 "orthogonal": "tab:green", "global_linear": "tab:purple", "mlp": "tab:brown"}
WHICH_STYLES = {"full": ("Δ_full", "-"), "tok": ("Δ_tok", "--"), "res": ("r", ":")}

# Per-layer panels: (column of layer_summary, title, y label, log scale)
LAYER_PANELS = (
    ("rel_err_median", "relative error ||r|| / ||Δ_full||", "median over tokens", False),
    ("cos_full_tok_median", "alignment, update form", "median cos(Δ_full, Δ_tok)", False),
    ("cos_full_tok_map_median", "alignment, map form", "median cos(y, T(x))", False),
    ("frac_res_angle_gt60", "residual angle > 60°", "share of tokens, angle(Δ_full, r)", False),
    (None, "projection on the top-16 tokenwise directions", "mean energy share", False),
    ("kl_mean", "output perturbation (r removed)", "mean KL(p || p_patched), nats", True),
    ("spearman_relerr_kl", "error vs perturbation", "Spearman(relative error, KL)", False),
    ("kl_ratio_random", "r's direction vs a random one (dashed: the null, 1)",
     "median KL(remove r) / KL(random, same norm)", True),
    ("effective_rank", "effective rank (solid Δ_full, dashed Δ_tok, dotted r)", "exp(entropy of σ² shares)", False),
)


# Margins in inches, fixed. Matplotlib's constrained layout measured every tick label of every panel to
# place them: 4.5 s of a 13 s report under cProfile (9 figures); a report of the tiny GPT-2 took 8.3 s
# with it, 5.2 s without. These leave room for a y label with its tick labels on the left of each panel
# (and on its right where it has a second axis), an x label below and a title above, with the figure's
# title above the top row.
LEFT, RIGHT, BOTTOM, TOP, TOP_TITLED = 1.0, 0.25, 0.6, 0.45, 0.8
H_GAP, V_GAP = 0.85, 0.95


def fixed_subplots(nrows: int, ncols: int, figsize: tuple[float, float], right: float = RIGHT, h_gap: float = H_GAP,
                   titled: bool = True, gridspec_kw: dict[str, object] | None = None) -> tuple[Figure, np.ndarray]:
    """plt.subplots with the fixed margins above (inches; `titled`: room for a figure title), squeeze off."""
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False, gridspec_kw=gridspec_kw)
    width, height = figsize
    top = TOP_TITLED if titled else TOP
    panel_w = (width - LEFT - right - (ncols - 1) * h_gap) / ncols
    panel_h = (height - BOTTOM - top - (nrows - 1) * V_GAP) / nrows
    fig.subplots_adjust(left=LEFT / width, right=1 - right / width, bottom=BOTTOM / height, top=1 - top / height,
                        wspace=h_gap / panel_w, hspace=V_GAP / panel_h)
    return fig, axes


def _colour(fn_class: str) -> str:
    return CLASS_COLOURS.get(fn_class, "tab:gray")


def band(ax: Axes, bands: pl.DataFrame, statistic: str, colour: object) -> None:
    """Shade the 95% band of a per-layer statistic (`layer_bands` columns `<statistic>_lo/_hi`, rows
    of one class); nothing where the statistic has no resamples."""
    lo, hi = f"{statistic}_lo", f"{statistic}_hi"
    if lo not in bands.columns or bands.is_empty():
        return
    rows = bands.filter(pl.col(lo).is_not_null() & pl.col(hi).is_not_null()).sort("layer")
    if len(rows):
        ax.fill_between(rows["layer"].to_numpy(), rows[lo].cast(pl.Float64).to_numpy(),
                        rows[hi].cast(pl.Float64).to_numpy(), color=colour, alpha=0.2, lw=0)


def layer_curves(summary: pl.DataFrame, ranks: pl.DataFrame, title: str, bands: pl.DataFrame | None = None) -> Figure:
    """Per-layer curves, one line per function class, with the 95% band over the resamples where
    `bands` (the `layer_bands` rows of the same model and config) has the statistic. `summary` is
    layer_summary rows of one (model, config); `ranks` has (layer, fn_class, which, effective_rank)."""
    fig, axes = fixed_subplots(3, 3, (15, 11), h_gap=1.2)  # log panels: wide tick labels
    classes = summary["fn_class"].unique(maintain_order=True).to_list()
    bands = pl.DataFrame() if bands is None else bands
    for ax, (column, panel_title, ylabel, log) in zip(axes.flat, LAYER_PANELS):
        for fn_class in classes:
            rows = summary.filter(pl.col("fn_class") == fn_class).sort("layer")
            layer = rows["layer"].to_numpy()
            colour = _colour(fn_class)
            mine = bands.filter(pl.col("fn_class") == fn_class) if not bands.is_empty() else bands
            if column is None:
                for which, (label, style) in WHICH_STYLES.items():
                    ax.plot(layer, rows[f"proj_{which}_m16"].to_numpy(), style, color=colour,
                            label=f"{fn_class}: {label}")
                band(ax, mine, "proj_res_m16", colour)
            elif column == "effective_rank":
                rk = ranks.filter(pl.col("fn_class") == fn_class)
                for which, (label, style) in WHICH_STYLES.items():
                    part = rk.filter(pl.col("which") == which).sort("layer")
                    ax.plot(part["layer"].to_numpy(), part["effective_rank"].to_numpy(), style,
                            color=colour, label=f"{fn_class}: {label}")
                    band(ax, mine, f"rank_{which}", colour)
            elif column in rows.columns and rows[column].null_count() < len(rows):
                ax.plot(layer, rows[column].cast(pl.Float64).to_numpy(), "o-", ms=3, color=colour,
                        label=fn_class)
                band(ax, mine, column, colour)
                null = f"{column}_null"  # the finding's null: the same measure without the claimed structure
                if null in rows.columns and rows[null].null_count() < len(rows):
                    ax.plot(layer, rows[null].cast(pl.Float64).to_numpy(), "x--", ms=3, lw=0.8, color=colour,
                            alpha=0.7, label=f"{fn_class}: null")
                    band(ax, mine, null, colour)
        if column == "kl_ratio_random":
            ax.axhline(1.0, ls="--", lw=0.8, color="gray")
        if log:
            ax.set_yscale("log")
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    axes.flat[4].legend(fontsize=7, ncol=1)
    fig.suptitle(title)
    return fig


def _per_layer_panels(rows: pl.DataFrame, layers: list[int], height: float, title: str
                      ) -> tuple[Figure, list[tuple[Axes, pl.DataFrame]]]:
    """One panel per chosen layer (titled early/middle/late when there are three), with its rows."""
    fig, axes = fixed_subplots(1, len(layers), (5 * len(layers), height))
    names = ["early", "middle", "late"] if len(layers) == 3 else [""] * len(layers)
    panels = []
    for ax, name, layer in zip(axes.flat, names, layers):
        ax.set_title(f"{name} layer {layer}", fontsize=10)
        panels.append((ax, rows.filter(pl.col("layer") == layer)))
    fig.suptitle(title)
    return fig, panels


def angle_histograms(angles: pl.DataFrame, layers: list[int], title: str) -> Figure:
    """Histograms of angle(Δ_full, r) for chosen layers; `angles` has (layer, fn_class, angle_full_res)."""
    fig, panels = _per_layer_panels(angles, layers, 3.6, title)
    bins = np.linspace(0, 180, 37)
    for ax, part in panels:
        for fn_class in part["fn_class"].unique(maintain_order=True).to_list():
            values = part.filter(pl.col("fn_class") == fn_class)["angle_full_res"].to_numpy()
            ax.hist(values, bins=list(bins), histtype="step", lw=1.5, color=_colour(fn_class),
                    label=f"{fn_class} ({np.mean(values > 60):.0%} > 60°)")
        ax.axvline(60, color="k", ls="--", lw=0.8)
        ax.set_xlabel("angle(Δ_full, r), degrees")
        ax.set_ylabel("tokens")
        ax.legend(fontsize=8)
    return fig


def error_vs_kl(points: pl.DataFrame, layers: list[int], title: str) -> Figure:
    """Scatter of relative error against KL per token; `points` has (layer, fn_class, rel_err, kl)."""
    fig, panels = _per_layer_panels(points, layers, 3.8, title)
    for ax, part in panels:
        for fn_class in part["fn_class"].unique(maintain_order=True).to_list():
            rows = part.filter(pl.col("fn_class") == fn_class)
            ax.scatter(rows["rel_err"].to_numpy(), np.maximum(rows["kl"].to_numpy(), 1e-8), s=3, alpha=0.35,
                       color=_colour(fn_class), label=fn_class, rasterized=True)
        ax.set_yscale("log")
        ax.set_xlabel("relative error ||r|| / ||Δ_full||")
        ax.set_ylabel("KL(p || p_patched), nats")
        ax.legend(fontsize=8, markerscale=4)
    return fig


def energy_curves(spectra: pl.DataFrame, layers: list[int], title: str) -> Figure:
    """Cumulative singular-value energy of Δ_full, Δ_tok and r; `spectra` has
    (layer, fn_class, which, idx, cum_energy)."""
    fig, panels = _per_layer_panels(spectra, layers, 3.8, title)
    for ax, part in panels:
        for fn_class in part["fn_class"].unique(maintain_order=True).to_list():
            for which, (name, style) in WHICH_STYLES.items():
                rows = part.filter((pl.col("fn_class") == fn_class) & (pl.col("which") == which)).sort("idx")
                ax.plot(rows["idx"].to_numpy() + 1, rows["cum_energy"].to_numpy(), style, color=_colour(fn_class),
                        label=f"{fn_class}: {name}")
        ax.axhline(0.9, color="k", ls="--", lw=0.6)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("number of singular directions")
        ax.set_ylabel("cumulative energy")
        ax.legend(fontsize=7)
    return fig


def controls(summary: pl.DataFrame, title: str, bands: pl.DataFrame | None = None) -> Figure:
    """Left: mean KL per layer, the residual removed vs the random-direction and cruder-class controls.
    Right: on the tokens whose later effect was measured, the KL at the patched position, the mean KL per
    later position over the horizon with r removed there and with the random control's move there instead
    (95% bands over documents where `bands`, the layer_bands rows, has them), and the Spearman correlation
    of the KL at the position with the later one (right axis). `summary` has (layer, fn_class, kl_mean,
    kl_mean_random_control, kl_mean_crude_control, kl_at_mean_on_later, kl_later_mean,
    kl_later_random_mean, spearman_kl_later)."""
    fig, ((ax, later_ax),) = fixed_subplots(1, 2, (14, 3.8), right=0.85, h_gap=1.5, titled=False)
    for fn_class in summary["fn_class"].unique(maintain_order=True).to_list():
        rows = summary.filter(pl.col("fn_class") == fn_class).sort("layer")
        ax.plot(rows["layer"].to_numpy(), rows["kl_mean"].to_numpy(), "o-", ms=3, color=_colour(fn_class),
                label=f"{fn_class}: residual removed")
    primary = summary.filter(pl.col("kl_mean_random_control").is_not_null()).sort("layer")
    for column, style, label in (("kl_mean_random_control", "k--", "random direction, same norm"),
                                 ("kl_mean_crude_control", "k:", "cruder tokenwise part, same residual"),
                                 ("kl_mean_context", "g-.", "the context's part a removed (y -> y_ctl)"),
                                 ("kl_mean_context_random", "g:", "a random move of ||a|| (a's shape)")):
        if column not in primary.columns:
            continue
        rows = primary.filter(pl.col(column).is_not_null())
        if len(rows):
            ax.plot(rows["layer"].to_numpy(), rows[column].to_numpy(), style, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean KL, nats")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    later = (summary.filter(pl.col("kl_later_mean").is_not_null()).sort("layer")
             if "kl_later_mean" in summary.columns else pl.DataFrame())
    if len(later):
        layer = later["layer"].to_numpy()
        later_ax.plot(layer, later["kl_at_mean_on_later"].to_numpy(), "o-", ms=3, color="tab:red",
                      label="KL at the patched position")
        later_ax.plot(layer, later["kl_later_mean"].to_numpy(), "s--", ms=3, color="tab:purple",
                      label="mean KL per later position, r removed")
        if "kl_later_random_mean" in later.columns and later["kl_later_random_mean"].is_not_null().any():
            later_ax.plot(layer, later["kl_later_random_mean"].to_numpy(), "^:", ms=3, color="black",
                          label="the same, random move of the same length")
        if bands is not None and not bands.is_empty():
            primary = bands.filter(pl.col("fn_class") == later["fn_class"][0])
            band(later_ax, primary, "kl_later_mean", "tab:purple")
            band(later_ax, primary, "kl_later_random_mean", "black")
        later_ax.set_yscale("log")
        rho_ax = later_ax.twinx()
        rho_ax.plot(layer, later["spearman_kl_later"].to_numpy(), "x:", ms=4, color="gray",
                    label="Spearman of the two (right axis)")
        rho_ax.set_ylim(-1, 1)
        rho_ax.set_ylabel("Spearman", fontsize=8)
        handles = later_ax.get_legend_handles_labels()[0] + rho_ax.get_legend_handles_labels()[0]
        later_ax.legend(handles, [str(h.get_label()) for h in handles], fontsize=8)
    later_ax.set_xlabel("layer")
    later_ax.set_ylabel("mean KL over the measured tokens, nats", fontsize=8)
    later_ax.grid(alpha=0.3)
    later_ax.set_title("one position's r removed: its own next token and the rest of the sequence", fontsize=10)
    return fig


# Comparison panels: (column of layer_summary, title, log scale)
COMPARISON_PANELS = (
    ("rel_err_median", "median relative error", False),
    ("cos_full_tok_median", "median cos(Δ_full, Δ_tok), update form", False),
    ("cos_full_tok_map_median", "median cos(y, T(x)), map form", False),
    ("frac_res_angle_gt60", "share of residual angles > 60°", False),
    ("proj_res_m16", "projection energy of r, top-16", False),
    ("kl_mean", "mean KL with r removed", True),
    ("spearman_relerr_kl", "Spearman(relative error, KL)", False),
)


SPLIT_CURVES = (("ctl_ratio_median", "‖Δ_ctl‖ / ‖Δ_full‖: the token's own update", "tab:blue"),
                ("ctx_ratio_median", "‖a‖ / ‖Δ_full‖: what the context adds", "tab:red"),
                ("cos_full_ctl_median", "cos(Δ_full, Δ_ctl)", "tab:green"))


def context_split(split: pl.DataFrame, title: str) -> Figure:
    """Per layer, the medians of the exact split (view `context_split_summary`) with their 95 % bootstrap
    bands over documents, and finding 1's threshold (0.9) for the cosine."""
    fig, ((ax,),) = fixed_subplots(1, 1, (9, 3.8), titled=False)
    rows = split.sort("layer")
    layer = rows["layer"].to_numpy()
    for column, label, colour in SPLIT_CURVES:
        ax.plot(layer, rows[column].to_numpy(), "o-", ms=3, color=colour, label=label)
        if f"{column}_lo" in rows.columns and rows[f"{column}_lo"].null_count() < len(rows):
            ax.fill_between(layer, rows[f"{column}_lo"].to_numpy().astype(float),
                            rows[f"{column}_hi"].to_numpy().astype(float), color=colour, alpha=0.2)
    ax.axhline(0.9, color="k", ls=":", lw=1, label="finding 1's threshold (cosine)")
    ax.set_xlabel("layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return fig


def context_heads(heads: pl.DataFrame, title: str) -> Figure:
    """From the `context_heads` rows of one model and configuration: left, a head x layer heat map of each
    head's share of the context part a (its context restored alone), the heads-together remainder
    annotated per layer; right, per layer the shares of a added by the sources 1, 2-4, 5-16 and more than
    16 positions back (stacked: they add up to 1), with the heads' mean attention mass on each bin as dots."""
    fig, ((left, right),) = fixed_subplots(1, 2, (13, 4.2), h_gap=1.4, gridspec_kw={"width_ratios": [1.2, 1]})
    rows = heads.sort(["layer", "idx"])
    layers = rows["layer"].unique().sort().to_list()
    per_head = rows.filter(pl.col("kind") == "head")
    n_heads = int(per_head["idx"].cast(pl.Int64).max() or 0) + 1 if len(per_head) else 0  # type: ignore[arg-type]
    grid = np.full((n_heads, len(layers)), np.nan)
    for r in per_head.iter_rows(named=True):
        grid[r["idx"], layers.index(r["layer"])] = r["share"]
    span = max(float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0, 1e-9)
    image = left.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-span, vmax=span, origin="lower",
                        extent=(-0.5, len(layers) - 0.5, -0.5, n_heads - 0.5))
    fig.colorbar(image, ax=left, label="share of a (head's context restored alone)")
    step = max(1, len(layers) // 15)
    left.set_xticks(range(0, len(layers), step), [str(v) for v in layers[::step]])
    left.set_xlabel("layer")
    left.set_ylabel("head")
    left.set_title("per head: <a_h, a> / ||a||^2", fontsize=9)
    bins = rows.filter(pl.col("kind") == "distance")
    bottom = np.zeros(len(layers))
    cmap = plt.get_cmap("viridis")
    labels = bins["source"].unique(maintain_order=True).to_list()
    for i, label in enumerate(labels):
        mine = bins.filter(pl.col("source") == label)
        share = np.array([mine.filter(pl.col("layer") == v)["share"].item() if v in mine["layer"] else 0.0
                          for v in layers])
        colour = cmap(i / max(1, len(labels) - 1))
        right.bar(range(len(layers)), share, bottom=bottom, color=colour, label=f"{label} back")
        mass = np.array([mine.filter(pl.col("layer") == v)["mass"].item() if v in mine["layer"] else np.nan
                         for v in layers])
        right.plot(np.arange(len(layers)) + 0.3, mass, "D", ms=6, color=colour, markeredgecolor="k",
                   markeredgewidth=0.8, zorder=3)
        bottom = bottom + share
    right.set_xticks(range(0, len(layers), step), [str(v) for v in layers[::step]])
    right.set_xlabel("layer")
    right.set_ylabel("share of a (bars) / attention mass (dots)")
    right.set_title("per source distance (context restored nearest first)", fontsize=9)
    right.legend(fontsize=7, ncol=2)
    right.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    return fig


def context_across_models(context: pl.DataFrame, title: str) -> Figure:
    """Per model on normalised depth (`context_split_summary` rows with `depth`, and `share_d1`, `share_far`
    from `context_heads` where stored): left, ||a|| / ||Δ_full|| and cos(Δ_full, Δ_ctl) medians with bands;
    right, the previous token's and the far sources' shares of a."""
    fig, ((left, right),) = fixed_subplots(1, 2, (13, 4))
    cmap = plt.get_cmap("tab10")
    for i, model in enumerate(context["model"].unique(maintain_order=True).to_list()):
        rows = context.filter(pl.col("model") == model).sort("depth")
        depth = rows["depth"].to_numpy()
        for column, style, label in (("ctx_ratio_median", "o-", "||a|| / ||Δ_full||"),
                                     ("cos_full_ctl_median", "s--", "cos(Δ_full, Δ_ctl)")):
            left.plot(depth, rows[column].to_numpy(), style, ms=3, color=cmap(i % 10), label=f"{model}: {label}")
            if f"{column}_lo" in rows.columns and rows[f"{column}_lo"].null_count() < len(rows):
                left.fill_between(depth, rows[f"{column}_lo"].to_numpy().astype(float),
                                  rows[f"{column}_hi"].to_numpy().astype(float), color=cmap(i % 10), alpha=0.15)
        for column, style, label in (("share_d1", "o-", "previous token"), ("share_far", "s--", "> 16 back")):
            if column in rows.columns and rows[column].null_count() < len(rows):
                right.plot(depth, rows[column].to_numpy().astype(float), style, ms=3, color=cmap(i % 10),
                           label=f"{model}: {label}")
    left.axhline(0.9, color="k", ls=":", lw=1)
    for ax, ylabel in ((left, "median over tokens"), (right, "share of a")):
        ax.set_xlabel("normalised depth")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def comparison_curves(summary: pl.DataFrame, title: str, bands: pl.DataFrame | None = None) -> Figure:
    """Side-by-side per-layer curves of several models against normalised depth, one line per
    model (its best class), with 95% bands where `bands` (`layer_bands` rows plus `depth`, of each
    model's shown class and config) has the statistic. `summary` has layer_summary columns plus
    `depth` in [0, 1]."""
    bands = pl.DataFrame() if bands is None else bands
    fig, axes = fixed_subplots(2, 4, (17, 7.5), h_gap=1.2)
    models = summary["model"].unique(maintain_order=True).to_list()
    cmap = plt.get_cmap("tab10")
    for ax, (column, panel_title, log) in zip(axes.flat, COMPARISON_PANELS):
        for i, model in enumerate(models):
            rows = summary.filter(pl.col("model") == model).sort("depth")
            if rows[column].null_count() == len(rows):
                continue
            ax.plot(rows["depth"].to_numpy(), rows[column].cast(pl.Float64).to_numpy(), "o-", ms=3,
                    color=cmap(i % 10), label=f"{model} ({rows['fn_class'][0]})")
            mine = bands.filter(pl.col("model") == model).with_columns(layer=pl.col("depth")) if not bands.is_empty() else bands
            band(ax, mine, column, cmap(i % 10))
        if column == "kl_ratio_random":
            ax.axhline(1.0, ls="--", lw=0.8, color="gray")
        if log:
            ax.set_yscale("log")
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("normalised depth (layer / (L - 1))")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    axes.flat[-1].axis("off")
    fig.suptitle(title)
    return fig


def depth_layers(layers: list[int]) -> list[int]:
    """An early, a middle and a late layer among those present (fewer if there are fewer layers)."""
    layers = sorted(set(layers))
    if len(layers) <= 3:
        return layers
    n = layers[-1] + 1
    picks = []
    for target in (n / 6, n / 2, 5 * n / 6):
        best = min(layers, key=lambda layer: abs(layer - target))
        if best not in picks:
            picks.append(best)
    return picks


def convergence(rows: pl.DataFrame, title: str) -> Figure:
    """Each finding against the sample size, one line per class with its 95% bootstrap band and the
    threshold dashed. `rows`: the `convergence` view of one model."""
    findings = sorted(rows["finding"].unique().to_list())
    cols = 4
    nrows = max(1, -(-len(findings) // cols))
    fig, axes = fixed_subplots(nrows, cols, (17, 3.6 * nrows))
    for ax, finding in zip(axes.flat, findings):
        part = rows.filter(pl.col("finding") == finding)
        if part["value"].drop_nulls().is_empty():  # e.g. finding 6 from a single layer
            ax.set_title(f"finding {finding} ({part['threshold'][0]})", fontsize=10)
            ax.text(0.5, 0.5, "no value at any size", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        for fn_class in part["fn_class"].unique(maintain_order=True).to_list():
            line = part.filter(pl.col("fn_class") == fn_class).sort("n_tokens")
            n = line["n_tokens"].to_numpy()
            ax.plot(n, line["value"].cast(pl.Float64).to_numpy(), "o-", ms=3, color=_colour(fn_class), label=fn_class)
            lo, hi = line["ci_lo"].cast(pl.Float64).to_numpy(), line["ci_hi"].cast(pl.Float64).to_numpy()
            if np.isfinite(lo).any():
                ax.fill_between(n, lo, hi, color=_colour(fn_class), alpha=0.2)
        bound = float(str(part["threshold"][0]).split()[-1])
        ax.axhline(bound, color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"finding {finding} ({part['threshold'][0]})", fontsize=10)
        ax.set_xlabel("tokens in the sample")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(findings):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    return fig
