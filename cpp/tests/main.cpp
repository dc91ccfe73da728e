// Runs every TEST case of the core test files (see check.h).
#include "check.h"

int main() { return cellcache_test::run_all(); }
