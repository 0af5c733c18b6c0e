"""Training (``asynccoll/_train``): GradSync against torch DDP, and its memory."""
