"""Model families and what the library knows of each: our Llama (``models.llama``: the model, its
parallel plan, its pipeline stages) and Hugging Face Llama-family decoders (``models.hf_decoders``);
``models.registry`` finds the plan of a model given without one. Imports ``parallel`` and ``ops`` only."""
