# Sourced on the GPU machine, from the project root, once the other dependencies are installed:
#   source scripts/device-env.sh && <command>
# Unpacks .device-extras/ (scripts/device-extras.sh) once per machine and puts it on PYTHONPATH.
_extras=/tmp/megamoe/extras
if [ -f .device-extras/site-cp312.tar.xz ] && [ ! -f "$_extras/ok" ]; then
  rm -rf "$_extras" && mkdir -p "$_extras"
  tar -xJf .device-extras/site-cp312.tar.xz -C "$_extras" && touch "$_extras/ok"
fi
[ -f "$_extras/ok" ] && export PYTHONPATH="$_extras:$PYTHONPATH"
unset _extras
