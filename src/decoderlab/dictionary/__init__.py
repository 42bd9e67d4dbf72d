"""Dictionary learning on a trained model: :func:`train_sae` trains a sparse autoencoder on one hook point's
activations (streamed from the model over a corpus) on the Lightning loop, with a run directory that resumes,
and writes it in SAELens's format (the SAE's math: :mod:`decoderlab.glassbox.sae`)."""

from .run import SAERun, SAETrainConfig, load_sae_run, train_sae

__all__ = ["SAETrainConfig", "SAERun", "train_sae", "load_sae_run"]
