"""Image inputs of vision-language models, front-end side: decoding and checking images
(`image.py`), the model's Hugging Face processor (`processing.py`) and the plain records that
carry an image's placeholder range and encoder inputs to the engine (`inputs.py`).

Nothing here runs in the engine loop or imports model code; see docs/multimodal.md.
"""
