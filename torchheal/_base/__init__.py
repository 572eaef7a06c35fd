"""The foundation every layer of torchheal may import: nothing here imports the rest of torchheal.

* ``config.py`` — the environment, read once into validated dataclasses.
* ``salvage_guard.py`` — the refusal of wrappers that read reduced tensors before the vote.
"""
