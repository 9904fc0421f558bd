// Compile-time attack: make the compiler print secret files in its error messages.
#include "/etc/shadow"
#include "@HOST_DIR@/secret.txt"
int main() { return 0; }
