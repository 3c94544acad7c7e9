"""Healthy jobs get no verdict at all: false alarms are defects."""

from conftest import SCRIPTS, run_job


def test_healthy_mlp_two_seeds(tmp_path, train_script):
    for seed in (0, 1):
        job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "40", "--seed", str(seed)],
                      run_dir=tmp_path / f"run{seed}")
        assert job.exit_code == 0, job.output[-3000:]
        assert job.report["status"] == "healthy", job.report
        assert job.report["verdicts"] == []
        assert job.report["world_size"] == 2
        assert job.report["schema"] == "rankwatch.report/v1"


def test_healthy_gradient_accumulation_four_ranks(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "4", str(train_script), "--steps", "25", "--accum", "3"])
    assert job.exit_code == 0, job.output[-3000:]
    assert job.report["verdicts"] == [], job.report


def test_healthy_cnn_with_dataloader_workers_and_no_sync(tmp_path):
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(SCRIPTS / "cnn_accum.py"), "--epochs", "2"])
    assert job.exit_code == 0, job.output[-3000:]
    assert job.report["verdicts"] == [], job.report


def test_module_mode_and_script_args(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "job.py").write_text(
        "import sys, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "assert sys.argv[1:] == ['--flag', 'x'], sys.argv\n"
        "assert __name__ == '__main__'\n"
        "dist.barrier(); dist.destroy_process_group()\n")
    job = run_job(tmp_path, ["--nproc-per-node", "2", "-m", "mypkg.job", "--flag", "x"],
                  env={"PYTHONPATH": str(tmp_path)})
    assert job.exit_code == 0, job.output[-3000:]
    assert job.report["status"] == "healthy"
