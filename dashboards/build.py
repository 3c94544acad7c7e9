"""rankwatch's Grafana dashboards, built in code with grafana-foundation-sdk.

    python dashboards/build.py          # rewrite dashboards/*.json
    python dashboards/build.py --check  # exit 1 if the checked-in JSON is stale

Three dashboards: the job overview (progress, step time, verdicts, verdict
annotations), the per-rank view (heatmaps across ranks: the rank that stands
out is a bright row), and collector health. Template variables: datasource,
run (the job) and rank. Queries use only metrics rankwatch exports
(rankwatch.collector.metrics.METRICS); a test holds them to that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    from grafana_foundation_sdk.builders import dashboard as gdash
    from grafana_foundation_sdk.builders import heatmap, prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as mdash
    from grafana_foundation_sdk.models import prometheus as mprom
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith("grafana_foundation_sdk") or __name__ != "__main__":
        raise
    sys.exit("dashboards/build.py needs grafana-foundation-sdk, which is not installed: "
             "pip install 'rankwatch[grafana]'")

HERE = Path(__file__).resolve().parent
DS = mdash.DataSourceRef(type_val="prometheus", uid="${datasource}")
GRAFANA_DS = mdash.DataSourceRef(type_val="grafana", uid="-- Grafana --")
RUN = 'run="$run"'
RANKS = 'run="$run", rank=~"$rank"'

VERDICT_KINDS = ("hang", "collective_mismatch", "crash", "nonfinite", "grad_spike", "weight_divergence",
                 "straggler", "oom", "memory_growth", "config_divergence", "duplicate_data", "broken_update")


def q(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    return query.legend_format(legend) if legend else query


# The run's page on the collector (report.html, live): a dashboard link, and a
# data link on every series that carries the run label. A browser gets in with
# the collector's one-time link (rankwatch collector link).
RUN_PAGE = "${collector}/runs/${run}"
SERIES_RUN_PAGE = "${collector}/runs/${__field.labels.run}"


def run_page_links() -> list[gdash.DashboardLink]:
    return [gdash.DashboardLink("rankwatch page of run ${__field.labels.run}").type(mdash.DashboardLinkType.LINK)
            .url(SERIES_RUN_PAGE).target_blank(True)]


def variables(board: gdash.Dashboard, with_rank: bool = True) -> gdash.Dashboard:
    board = board.with_variable(gdash.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    board = board.with_variable(gdash.TextBoxVariable("collector").label("rankwatch collector URL")
                                .default_value("http://127.0.0.1:8765"))
    board = board.link(gdash.DashboardLink("rankwatch page of this run").type(mdash.DashboardLinkType.LINK)
                       .url(RUN_PAGE).target_blank(True).icon("external link"))
    board = board.with_variable(
        gdash.QueryVariable("run").label("Job (run id)").datasource(DS)
        .query("label_values(rankwatch_world_size, run)").refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED))
    if with_rank:
        board = board.with_variable(
            gdash.QueryVariable("rank").label("Rank").datasource(DS)
            .query('label_values(rankwatch_step{run="$run"}, rank)').multi(True).include_all(True)
            .all_value(".*").refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED))
    return board


def verdict_annotations(board: gdash.Dashboard) -> gdash.Dashboard:
    """Verdicts the collector posted to Grafana (tags: rankwatch, the kind, the run)."""
    target = gdash.AnnotationTarget().type("tags").tags(["rankwatch", "$run"]).match_any(False).limit(500)
    return board.annotation(gdash.AnnotationQuery().name("rankwatch verdicts").datasource(GRAFANA_DS)
                            .enable(True).icon_color("red").target(target))


def rank_heatmap(title: str, expr: str, unit: str, description: str) -> heatmap.Panel:
    """Time on x, one row per rank: the rank that stands out is a bright row."""
    return (heatmap.Panel().title(title).description(description).datasource(DS)
            .with_target(q(expr, "rank {{rank}}").format(mprom.PromQueryFormat.TIME_SERIES))
            .calculate(False).unit(unit).height(8).span(12)
            .color(heatmap.HeatmapColorOptions().mode(heatmap_color_mode()).scheme("Oranges").steps(64))
            .show_legend().y_axis(heatmap.YAxisConfig().axis_label("rank")).data_links(run_page_links()))


def heatmap_color_mode():
    from grafana_foundation_sdk.models import heatmap as mheat

    return mheat.HeatmapColorMode.SCHEME


def overview() -> gdash.Dashboard:
    board = (gdash.Dashboard("rankwatch / Job overview").uid("rankwatch-overview")
             .description("Progress, step time and the verdicts of one distributed training job.")
             .tags(["rankwatch", "pytorch", "distributed"]).refresh("10s").time("now-1h", "now").editable())
    board = verdict_annotations(variables(board, with_rank=False))
    board = board.with_row(gdash.Row("Health"))
    board = board.with_panel(stat.Panel().title("Ranks").datasource(DS).height(4).span(4)
                             .with_target(q(f"rankwatch_world_size{{{RUN}}}")))
    board = board.with_panel(stat.Panel().title("Seconds since progress").description(
        "hang: no rank made progress for this long; a verdict comes once it passes the hang timeout.")
        .datasource(DS).unit("s").height(4).span(4)
        .with_target(q(f"rankwatch_seconds_since_progress{{{RUN}}}"))
        .with_target(q(f"rankwatch_hang_timeout_seconds{{{RUN}}}", "timeout", "B")))
    board = board.with_panel(stat.Panel().title("Ranks up").datasource(DS).height(4).span(4)
                             .description("crash: a rank that exited shows 0.")
                             .with_target(q(f"sum(rankwatch_rank_up{{{RUN}}})")))
    board = board.with_row(gdash.Row("Verdicts"))
    for kind in VERDICT_KINDS:
        board = board.with_panel(
            stat.Panel().title(f"{kind}").description(f"Verdicts of kind {kind} and the ranks they name.")
            .datasource(DS).height(3).span(3)
            .with_target(q(f'rankwatch_verdicts{{{RUN}, kind="{kind}"}}', kind))
            .with_target(q(f'rankwatch_suspect_rank{{{RUN}, kind="{kind}"}}', "rank {{rank}}", "B"))
            .data_links(run_page_links()))
    board = board.with_row(gdash.Row("Progress"))
    board = board.with_panel(timeseries.Panel().title("Optimizer steps").datasource(DS).height(8).span(12)
                             .with_target(q(f"max(rankwatch_step{{{RUN}}})", "step")))
    board = board.with_panel(timeseries.Panel().title("Step time (slowest rank sets the pace)").datasource(DS)
                             .unit("s").height(8).span(12)
                             .with_target(q(f"max(rankwatch_step_duration_seconds{{{RUN}}})", "step"))
                             .with_target(q(f"max(rankwatch_compute_seconds{{{RUN}}})", "slowest own time", "B"))
                             .with_target(q(f"min(rankwatch_compute_seconds{{{RUN}}})", "fastest own time", "C")))
    board = board.with_panel(timeseries.Panel().title("Loss by rank").datasource(DS).height(8).span(12)
                             .with_target(q(f"rankwatch_loss{{{RUN}}}", "rank {{rank}}")))
    board = board.with_panel(timeseries.Panel().title("Non-finite steps by rank").datasource(DS).height(8)
                             .span(12).description("nonfinite: NaN/Inf in a rank's local loss or gradients.")
                             .with_target(q(f"rankwatch_nonfinite_steps_total{{{RUN}}}", "rank {{rank}}")))
    return board


def per_rank() -> gdash.Dashboard:
    board = (gdash.Dashboard("rankwatch / Ranks").uid("rankwatch-ranks")
             .description("Every rank side by side: heatmaps across ranks, so the one that stands out is obvious.")
             .tags(["rankwatch", "pytorch", "distributed"]).refresh("10s").time("now-1h", "now").editable())
    board = verdict_annotations(variables(board))
    panels = [
        ("Own time per step (compute, waiting excluded)", f"rankwatch_compute_seconds{{{RANKS}}}", "s",
         "straggler: the slow rank is the bright row; in DDP every rank's step time is the same."),
        ("Straggler score (own time / peers' median)", f"rankwatch_straggler_score{{{RANKS}}}", "none",
         "straggler: above 1.33 persistently."),
        ("Step time", f"rankwatch_step_duration_seconds{{{RANKS}}}", "s", "Waiting for peers included."),
        ("Data loading time", f"rankwatch_data_seconds{{{RANKS}}}", "s", "straggler in the data pipeline."),
        ("Local gradient norm (before the allreduce)", f"rankwatch_grad_norm{{{RANKS}}}", "none",
         "grad_spike: a rank's norm far above its peers' and its own history."),
        ("Host memory (RSS)", f"rankwatch_memory_rss_bytes{{{RANKS}}}", "bytes",
         "memory_growth / oom: a rank whose row keeps brightening leaks."),
        ("Device memory allocated", f"rankwatch_device_memory_allocated_bytes{{{RANKS}}}", "bytes",
         "memory_growth / oom on the GPU."),
        ("Heartbeat age", f"rankwatch_heartbeat_age_seconds{{{RANKS}}}", "s",
         "hang / crash: a rank whose heartbeat stopped."),
        ("Collective sequence number", f"rankwatch_collective_sequence{{{RANKS}}}", "none",
         "collective_mismatch / hang: ranks behind or ahead of the others."),
    ]
    for title, expr, unit, description in panels:
        board = board.with_panel(rank_heatmap(title, expr, unit, description))
    board = board.with_panel(timeseries.Panel().title("Straggler score by rank").datasource(DS).height(8)
                             .span(24).with_target(q(f"rankwatch_straggler_score{{{RANKS}}}", "rank {{rank}}")))
    board = board.with_panel(stat.Panel().title("Weight divergence: ranks named").datasource(DS).height(4)
                             .span(24).description("weight_divergence: replicas whose weights differ.")
                             .with_target(q(f'rankwatch_suspect_rank{{{RUN}, kind="weight_divergence"}}',
                                            "rank {{rank}}")))
    return board


def collector_health() -> gdash.Dashboard:
    board = (gdash.Dashboard("rankwatch / Collector").uid("rankwatch-collector")
             .description("Is rankwatch itself healthy: ranks reporting, ingest latency, bundles.")
             .tags(["rankwatch"]).refresh("30s").time("now-3h", "now").editable())
    board = variables(board, with_rank=False)
    board = board.with_panel(timeseries.Panel().title("Ranks reporting").datasource(DS).height(8).span(12)
                             .with_target(q(f"count(rankwatch_heartbeat_age_seconds{{{RUN}}} < 10)", "fresh"))
                             .with_target(q(f"rankwatch_world_size{{{RUN}}}", "world size", "B")))
    board = board.with_panel(timeseries.Panel().title("Heartbeat ingest latency").datasource(DS).unit("s")
                             .height(8).span(12)
                             .with_target(q("histogram_quantile(0.99, sum by (le) "
                                            "(rate(rankwatch_ingest_latency_seconds_bucket[5m])))", "p99"))
                             .with_target(q("histogram_quantile(0.5, sum by (le) "
                                            "(rate(rankwatch_ingest_latency_seconds_bucket[5m])))", "p50", "B")))
    board = board.with_panel(timeseries.Panel().title("Bundles").datasource(DS).height(8).span(12)
                             .with_target(q("rate(rankwatch_bundles_received_total[5m])", "received"))
                             .with_target(q("rate(rankwatch_bundles_rejected_total[5m])", "rejected", "B")))
    board = board.with_panel(timeseries.Panel().title("Oldest heartbeat").datasource(DS).unit("s").height(8)
                             .span(12).with_target(q(f"max(rankwatch_heartbeat_age_seconds{{{RUN}}})", "max age")))
    return board


DASHBOARDS = {"overview.json": overview, "ranks.json": per_rank, "collector.json": collector_health}


def render() -> dict[str, str]:
    encoder = JSONEncoder(sort_keys=True, indent=2)
    return {name: encoder.encode(fn().build()) + "\n" for name, fn in DASHBOARDS.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the checked-in JSON is not current")
    args = parser.parse_args()
    stale = []
    for name, text in render().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale dashboards (run python dashboards/build.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
