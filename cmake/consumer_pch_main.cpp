// The owner of the precompiled header that tests, examples and benchmarks share
// (cmake/consumer_pch.cmake); nothing runs it.
int main() { return 0; }
