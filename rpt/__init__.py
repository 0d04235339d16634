"""rpt: recurrent pretraining. Deep recurrent language models from one CPU to many GPUs."""

__version__ = "0.1.0"
