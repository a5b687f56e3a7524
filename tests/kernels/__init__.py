"""Test-only kernels, kept out of the installed packages: the ``ts_pipeline`` probes
(:mod:`.pipeline_probe_sm90`, :mod:`.pipeline_probe_sm100`) and their PTX builds
(:mod:`.probe_builds`)."""
