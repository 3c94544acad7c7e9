"""What rankwatch produces from a run's report and state, for people and tools:

- `report`: report.json on disk and the printed summary;
- `plot`: the matplotlib picture (`analyze --plot`);
- `tensorboard`: TensorBoard scalars (`analyze --tensorboard`);
- `grafana`: dashboards and annotations pushed to Grafana (`rankwatch grafana push`).
"""
