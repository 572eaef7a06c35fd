"""The foundation every layer of torchheal may import: nothing here imports the rest of torchheal.

* ``env.py`` — the one reader of ``os.environ`` and the parsing the settings modules share;
  ``manager_env.py``, ``manager_timeouts.py``, ``launch_env.py``, ``security.py``,
  ``telemetry_env.py`` — the environment, read once into validated dataclasses, by concern.
* ``timeouts.py`` — ``to_seconds``, the one timeout conversion.
* ``salvage_guard.py`` — the refusal of wrappers that read reduced tensors before the vote.
"""
