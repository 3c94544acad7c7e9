"""Numerical health, checked on local gradients before the allreduce, in real
multi-rank DDP jobs (gloo, CPU)."""

from __future__ import annotations

from conftest import ddp_script, run_job


def test_nan_in_one_ranks_batch_names_origin_step_and_parameter(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "4", str(train_script), "--steps", "20",
                             "--fault", "nan", "--fault-rank", "3", "--fault-step", "6"])
    nonfinite = job.only("nonfinite")
    assert nonfinite["ranks"] == [3], "the origin, not every rank the average contaminated"
    assert nonfinite["step"] == 6
    assert nonfinite["evidence"]["parameters"][0] == "0.weight"
    assert "0.weight" in nonfinite["summary"]
    # The NaN is in rank 3's input batch: its loss was already NaN in the forward.
    assert nonfinite["evidence"]["loss_nonfinite_in_forward"] == [3]
    assert "already non-finite in the forward" in nonfinite["summary"] and "batch" in nonfinite["summary"]
    assert len(job.verdicts()) == 1
    # The origin rank was switched to autograd anomaly mode, and only it.
    assert (job.run_dir / "report.json").exists()


def test_one_ranks_batch_scaled_is_a_grad_spike_on_that_rank_only(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "4", str(train_script), "--steps", "25",
                             "--fault", "spike", "--fault-rank", "1", "--fault-step", "12"])
    spike = job.only("grad_spike")
    assert spike["ranks"] == [1]
    assert spike["step"] == 12
    assert all(v["ranks"] == [1] for v in job.verdicts()), \
        f"the post-allreduce blow-up on every rank is not blamed on all: {job.verdicts()}"


def test_ppo_value_targets_scaled_on_one_rank_is_a_grad_spike_there(tmp_path):
    """A small PPO (several minibatch updates per rollout, clipping, a loss that
    is often negative): one rank's value targets x 10^4 for one update."""
    from conftest import SCRIPTS

    job = run_job(tmp_path, ["--nproc-per-node", "4", str(SCRIPTS / "ppo_small.py"),
                             "--bad-rank", "2", "--bad-step", "50"])
    assert job.exit_code == 0, job.output[-3000:]
    spike = job.only("grad_spike")
    assert (spike["ranks"], spike["step"]) == ([2], 50)
    assert len(job.verdicts()) == 1, job.verdicts()


def test_perturbed_replica_is_weight_divergence(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "4", str(train_script), "--steps", "25",
                             "--fault", "perturb", "--fault-rank", "2", "--fault-step", "7"])
    divergence = job.only("weight_divergence")
    assert divergence["ranks"] == [2]
    assert divergence["step"] >= 7
    assert "0.weight" in divergence["summary"]


def test_user_comm_hook_still_runs(tmp_path):
    script = ddp_script(tmp_path, "hooked.py", """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        calls = []
        def my_hook(state, bucket):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)
        model = DDP(torch.nn.Linear(8, 8))
        model.register_comm_hook(None, my_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(dist.get_rank())  # each rank its own data
        for step in range(6):
            opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step()
        assert len(calls) == 6, calls
        open(f"hook_calls_{dist.get_rank()}", "w").write(str(len(calls)))
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)])
    assert job.exit_code == 0, job.output[-3000:]
    assert [(tmp_path / f"hook_calls_{r}").read_text() for r in (0, 1)] == ["6", "6"]
    assert job.report["status"] == "healthy"
    from rankwatch.collector.offline import load

    run, _ = load(job.run_dir)
    # Tiny steps: the cost budget may sample every N-th step; the sampled ones have a norm.
    missing = [(s.rank, r.step) for s in run.ranks.values() for r in s.steps.values()
               if r.grad_norm is None and r.grad_check_stride == 1]
    assert all(s.steps[0].grad_norm is not None for s in run.ranks.values())
    assert not missing, \
        f"local gradient norms were measured through the user's hook: {missing}"


def test_healthy_run_with_grad_scaler_overflows_and_warmup(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "40", "--scaler",
                             "--overflow-every", "6", "--warmup", "10", "--seed", "3"])
    assert job.exit_code == 0, job.output[-3000:]
    assert job.report["verdicts"] == [], job.report


def test_unused_parameter_named_when_ddp_fails_to_finish_reduction(tmp_path):
    script = ddp_script(tmp_path, "unused.py", """
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.encoder = torch.nn.Linear(8, 8)
                self.head = torch.nn.Linear(8, 1)
                self.aux_head = torch.nn.Linear(8, 3)  # defined, never used in forward
            def forward(self, x):
                return self.head(self.encoder(x))
        model = DDP(M())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)])
    assert job.exit_code != 0
    crash = job.only("crash")
    assert "finished reduction" in crash["summary"]
    assert sorted(crash["evidence"]["unused_parameters"]) == ["aux_head.bias", "aux_head.weight"]
    assert "aux_head.weight" in crash["summary"]


def test_always_zero_gradient_is_noted_without_a_false_verdict(tmp_path):
    script = ddp_script(tmp_path, "frozen.py", """
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body = torch.nn.Linear(8, 8)
                self.gate = torch.nn.Parameter(torch.ones(8))
            def forward(self, x):
                return (self.body(x) + 0.0 * self.gate).sum()  # gate's gradient is always 0
        model = DDP(M())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        torch.manual_seed(dist.get_rank())  # each rank its own data
        for step in range(40):
            opt.zero_grad(); model(torch.randn(4, 8)).backward(); opt.step()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)])
    assert job.exit_code == 0, job.output[-2000:]
    assert job.report["verdicts"] == []
    assert any("always had an exactly zero gradient" in n and "gate" in n for n in job.report["notes"])


def test_nan_only_in_one_ranks_gradients_is_not_blamed_on_its_batch(tmp_path):
    """A backward that makes NaN from a finite loss (a bad custom op, a
    gradient hook): the loss was finite, so the summary does not send the
    user to the input batch."""
    script = ddp_script(tmp_path, "grad_nan.py", """
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        state = {"step": 0}
        def poison(grad):
            if dist.get_rank() == 1 and state["step"] == 5:
                return grad * float("nan")
            return grad
        model.module[2].weight.register_hook(poison)
        for step in range(12):
            state["step"] = step
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
            opt.step()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    nonfinite = job.only("nonfinite")
    assert (nonfinite["ranks"], nonfinite["step"]) == ([1], 5)
    assert nonfinite["evidence"]["loss_nonfinite_in_forward"] == []
    assert "in the forward" not in nonfinite["summary"]


# -- a dead run (issue 26) ---------------------------------------------------------------------------


def _dead_run_job(tmp_path, train_script, env=None, steps=60):
    # A NaN in rank 1's batch at step 3: from then on every rank's loss is NaN (weights NaN after the average).
    return run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", str(steps), "--step-time", "0.05",
                              "--fault", "nan", "--fault-rank", "1", "--fault-step", "3"], env=env)


def test_a_dead_run_is_said_loudly_once_and_left_running_by_default(tmp_path, train_script):
    job = _dead_run_job(tmp_path, train_script)
    assert job.exit_code == 0, job.output[-3000:]
    nonfinite = job.only("nonfinite")
    assert nonfinite["ranks"] == [1] and len(job.verdicts()) == 1  # one incident, one verdict
    dead = nonfinite["evidence"]["dead_run"]
    assert 3 <= dead["since_step"] <= 5 and dead["confirmed_at_step"] == dead["since_step"] + 2
    assert "Training is dead" in nonfinite["summary"]
    assert job.output.count("TRAINING IS DEAD") == 1, job.output[-3000:]
    assert "The job goes on (on_dead_run: abort would end it)" in job.output
    assert "step 50 loss nan" in job.output  # left running, as the default says


def test_a_dead_run_is_ended_with_on_dead_run_abort(tmp_path, train_script):
    # 600 steps of 0.05 s: 30 s if nothing ends it, so the end is told apart from a finished run even on a
    # loaded machine (60 steps were 3 s, less than a busy CI's verdict and kill took once).
    job = _dead_run_job(tmp_path, train_script, env={"RANKWATCH_ON_DEAD_RUN": "abort"}, steps=600)
    assert job.exit_code != 0, job.output[-3000:]
    assert "Ending the job (on_dead_run: abort)" in job.output
    assert "rankwatch ending the job: rankwatch ended the dead run" in job.output  # after torchrun's exitcode -15
    nonfinite = job.only("nonfinite")
    assert "dead_run" in nonfinite["evidence"] and len(job.verdicts()) == 1
    assert job.report["status"] == "faulty"
    assert "step 590 loss" not in job.output  # ended: the 600 steps were not all run
