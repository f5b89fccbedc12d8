// moecore command-line entry point.
#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  std::printf("usage: moecore <train|inspect> [options]\n");
  return argc > 1 && std::strcmp(argv[1], "--help") == 0 ? 0 : 2;
}
