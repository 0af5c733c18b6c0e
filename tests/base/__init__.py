"""The base every room stands on (``asynccoll/_base``): the one boundary for foreign errors."""
