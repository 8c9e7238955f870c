"""Lab 05's code (also used by labs 06 and 07): the models, the lean decoder, the server and its load tests."""
