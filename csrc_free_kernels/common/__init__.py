"""What every kernel family shares: the family record's types (``family``), the compile
and its caches (``compile``, ``kernel_cache``, ``kernel_cache_path``) and scratch folders
(``scratch``), the configuration base and the decline (``kernel_config``), programmatic
dependent launch (``pdl``), the kernels' switches (``settings``) and the ragged tile
schedules (``tile_schedule``)."""
