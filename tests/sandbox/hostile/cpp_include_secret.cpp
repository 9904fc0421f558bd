// Compile-time attack: make the compiler print secret files in its error messages.
#include "@HOST_DIR@/secret.txt"
#include "/etc/shadow"
int main() { return 0; }
