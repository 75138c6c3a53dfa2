"""DeepSpeed's ``DistributedTest`` adopted: ``adopter.py`` in the pytest process, ``ranks.py``
in each rank, and what only DeepSpeed's runs need (``shm_buffers.py``, ``build_lock.py``)."""
