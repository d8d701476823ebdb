"""Likelihood figures of one sample: its full-KV continuation teacher-forced through the full cache and
a method's compressed cache (`kvlab.engine.teacher_forced_logits`), scored by `kvlab.bench.likelihood`."""

from __future__ import annotations

from kvlab.bench.likelihood import LikelihoodFigures, likelihood_figures
from kvlab.engine import TeacherForcing, teacher_forced_logits
from kvlab.models import LoadedModel

__all__ = ["TeacherForcing", "measure_likelihood"]


def measure_likelihood(loaded: LoadedModel, forcing: TeacherForcing) -> LikelihoodFigures:
    """KL and perplexities of the continuation under the full and the compressed cache."""
    full, compressed = teacher_forced_logits(loaded, forcing)
    return likelihood_figures(full, compressed, forcing.continuation)
