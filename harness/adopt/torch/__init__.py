"""torch's ``MultiProcessTestCase`` family adopted: ``adopter.py`` in the pytest process,
``ranks.py`` in each rank."""
