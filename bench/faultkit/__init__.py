"""faultbench: an open fault benchmark for distributed PyTorch training
(`python bench/faultbench.py`). Modules: plan (what runs), inject/ (the
injector every worker loads), jobs/ (the job shapes), tools (running each
tool and reading its answer), scoring (pure metrics), report (table, plot)."""
