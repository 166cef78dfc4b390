"""Benchmark JSON names its commit (dirty or not), versions and GPU."""
import subprocess

import torch

from atom.benchmarks.provenance import git_commit, provenance


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


def test_commit_of_a_checkout_and_its_dirty_state(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-qm", "first")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked files do not make it dirty\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert git_commit(tmp_path) == head + "+dirty"


def test_no_commit_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # wherever the tmp dir lies
    assert git_commit(tmp_path) is None


def test_provenance_keys():
    info = provenance()
    assert info["torch"] == torch.__version__
    assert "commit" in info
    assert ("gpu_uuid" in info) == ("gpu_name" in info) == torch.cuda.is_available()


def test_the_commit_named_by_the_environment_wins(tmp_path, monkeypatch):
    """A tree copied to another machine with a stale .git names its commit by ATOM_BENCH_COMMIT."""
    monkeypatch.setenv("ATOM_BENCH_COMMIT", "abc1234")
    assert git_commit(tmp_path) == "abc1234"
    assert provenance()["commit"] == "abc1234"
